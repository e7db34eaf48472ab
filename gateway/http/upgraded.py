"""A connection after `101 Switching Protocols`: raw bytes both ways, no more HTTP.

`UpgradedStream` has the interface of httpcore's `AsyncNetworkStream` (`read`, `write`, `aclose`,
`get_extra_info`), which httpx hands over as the `network_stream` extension of a 101 response. Both
ends of a WebSocket tunnel are one: the upstream's (gateway/http/transport.py gives it for its
101 answers, as httpcore does) and the client's (gateway/http/exchange.py gives it to the app that
accepts an upgrade). gateway/tunnel.py relays between two of them.

Bytes received wait in a queue; past `high_water` of them the socket is paused until `read` takes
them, and `write` returns once the socket's own write buffer is below its low-water mark: a side
whose peer does not read is not read either, so a tunnel holds a bounded number of bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol


class Side(Protocol):
    """The asyncio protocol that owns the socket (a server or an upstream connection)."""

    def pause_side(self) -> None: ...      # stop reading the socket
    def resume_side(self) -> None: ...     # read it again
    async def writable(self, written: int) -> None: ...  # `written` bytes just went to the socket: wait
    # while the write buffer is full; raises once it is gone


class UpgradedStream:
    def __init__(self, side: Side, transport: asyncio.BaseTransport, loop: asyncio.AbstractEventLoop,
                 high_water: int) -> None:
        self.side = side
        self.transport: Any = transport  # uvloop's transports are not asyncio.Transport subclasses
        self.loop = loop
        self.high_water = high_water
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # --- fed by the owning protocol ------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > self.high_water and not self.paused:
            self.paused = True
            self.side.pause_side()
        self._wake()

    def end(self) -> None:
        """The peer closed (or half-closed) the connection: `read` returns b"" once the queue is empty."""
        self.ended = True
        self._wake()

    # --- httpcore's AsyncNetworkStream ---------------------------------------------------------

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Up to `max_bytes` received bytes, waiting for some; b"" at the end. (No timeout of its
        own: the tunnel's idle timeout applies.)"""
        while not self.chunks:
            if self.ended:
                return b""
            self.waiter = self.loop.create_future()
            await self.waiter
        chunk = self.chunks.popleft()
        if len(chunk) > max_bytes:
            self.chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        elif self.chunks and len(chunk) + len(self.chunks[0]) <= max_bytes:
            parts = [chunk]
            size = len(chunk)
            while self.chunks and size + len(self.chunks[0]) <= max_bytes:
                size += len(self.chunks[0])
                parts.append(self.chunks.popleft())
            chunk = b"".join(parts)
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= self.high_water:
            self.paused = False
            self.side.resume_side()
        return chunk

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.transport.write(buffer)
        await self.side.writable(len(buffer))

    async def aclose(self) -> None:
        self.ended = True
        self.transport.close()
        self._wake()

    def get_extra_info(self, info: str) -> Any:
        return self.transport.get_extra_info(info)

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
