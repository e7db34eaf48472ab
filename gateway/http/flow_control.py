"""A client connection's flow, as uvicorn keeps it beside its protocol: reading paused while a
request's body waits for the app, writing paused while the transport's buffer is full (`drain`
waits until it empties), and whether the client takes its answer at all: one that takes nothing
for `send_timeout` is cut, with a reset (`took_nothing`, `cut`)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Callable

READ_HIGH_WATER = 64 * 1024  # request body bytes buffered before the client socket is paused
SEND_CHECKS = 8  # a waiting client's progress is looked at this often per send_timeout (at most 1 s apart)

log = logging.getLogger("gateway.http")


def unsent_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes written to a connection that its peer has not taken yet: the transport's buffer and
    the kernel's send queue (SIOCOUTQ, Linux's TIOCOUTQ on a socket)."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # closed meanwhile
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return queued


class FlowControl:
    """One connection's flow. `on_cut` is called when the client is cut, before its transport is
    aborted."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, send_timeout: float,
                 on_cut: Callable[[], None]) -> None:
        self.transport = transport
        self.loop = loop
        self.send_timeout = send_timeout
        self.send_check = min(send_timeout / SEND_CHECKS, 1.0)
        self.on_cut = on_cut
        self.read_paused = False
        self.write_paused = False
        self.drain_waiters: list[asyncio.Future[None]] = []
        # whether the client takes its answer (`took_nothing`)
        self.expected = -1            # bytes unsent at the last look (-1: not looked at yet in this answer)
        self.written_since = 0        # bytes handed to the transport since then
        self.looked_at = 0.0
        self.taken_at = 0.0           # the last look that found the client had taken bytes (or had none waiting)

    def pause_reading(self) -> None:
        if not self.read_paused and not self.transport.is_closing():
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    def lost(self) -> None:
        """The connection is gone: whatever waits to write wakes (and finds it closed)."""
        self.write_paused = False
        self._wake_drain()

    def answer_begins(self) -> None:
        """A new answer: whether the client takes it is judged from its first look."""
        self.expected = -1

    async def drain(self) -> None:
        """Wait until the client takes what was written; a client that takes nothing for
        `send_timeout` is cut: ConnectionResetError, and its call is cancelled (connection_lost)."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        self.drain_waiters.append(waiter)
        while True:
            done, _ = await asyncio.wait((waiter,), timeout=self.send_check)
            if done:
                return
            if self.took_nothing(0):
                self.cut()
                raise ConnectionResetError("the client took nothing of its answer")

    def took_nothing(self, written: int) -> bool:
        """Whether the client has taken none of the bytes waiting for it for `send_timeout`, just
        after `written` more were handed to the transport. Looked at as a streamed answer goes out
        (at most every half `send_check`: a look is a system call) and every `send_check` seconds
        while a write waits: by the bytes still unsent (the transport's buffer and the kernel's
        queue), not by the socket being writable. On loopback the kernel queues megabytes before
        the transport's buffer fills, which a slow stream takes minutes to fill; and it reports a
        full socket writable only once half its queue is gone, which a slow reader that keeps
        reading can take longer than `send_timeout` to make room for."""
        now = self.loop.time()
        self.written_since += written
        if self.expected >= 0 and now - self.looked_at < self.send_check / 2:
            return False
        unsent = unsent_bytes(self.transport)
        if self.expected < 0 or unsent == 0 or unsent < self.expected + self.written_since:
            self.taken_at = now
        self.expected = unsent
        self.written_since = 0
        self.looked_at = now
        return now - self.taken_at >= self.send_timeout

    def cut(self) -> None:
        """Cut a client that took nothing of its answer for `send_timeout`: with a reset, as nginx's
        reset_timedout_connection, so the kernel drops the megabytes still queued for it instead of
        keeping them for a peer that may never read (a close leaves them queued, and no FIN goes)."""
        log.info("a client took nothing of its answer for %.0fs: connection cut", self.send_timeout)
        self.on_cut()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _wake_drain(self) -> None:
        waiters, self.drain_waiters = self.drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
