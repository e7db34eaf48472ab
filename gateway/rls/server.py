"""The RLS port's gRPC server: unary calls over HTTP/2 cleartext, on the h2 library's state machine.

h2 (already the HTTP/2 of httpx[http2]) does the framing, HPACK, flow control, SETTINGS, PING and
GOAWAY; this file adds what gRPC puts on top for unary calls: the path names the method, the body is
one length-prefixed message, the status goes in trailers. It was chosen by measurement over
grpcio's asyncio server and grpclib (docs/benchmarks.md, "Envoy rate limit service"), which
tests/support/rls_comparison.py runs through the same tests.

Bounds: 1024 concurrent streams a connection (more is h2's REFUSED_STREAM), 16 KiB of headers, one
message of at most MAX_MESSAGE bytes (more: RESOURCE_EXHAUSTED, nothing counted), no compression
(a compressed message: UNIMPLEMENTED). A stream the client resets is cancelled, its call with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import cast
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from gateway.rls.service import (
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    GrpcError,
)

log = logging.getLogger("gateway.rls")

MAX_MESSAGE = 64 * 1024
MAX_STREAMS = 1024
MAX_HEADER_LIST = 16 * 1024
INTERNAL = 13
_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # h2's own checks of every header field cost more than the call; only :method, :path and
    # content-type are read, and each is checked here
    validate_inbound_headers=False, validate_outbound_headers=False,
    normalize_inbound_headers=False, normalize_outbound_headers=False,
)
_RESPONSE_HEAD = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_OK_TRAILERS = [(b"grpc-status", b"0")]

Unary = Callable[[bytes], Awaitable[bytes]]


class _Stream:
    __slots__ = ("body", "method", "refused")

    def __init__(self, method: bytes) -> None:
        self.method = method
        self.body = bytearray()
        self.refused = False  # answered already (too large): the rest of its body is dropped


class GrpcProtocol(asyncio.Protocol):
    """One HTTP/2 connection of unary gRPC calls: `calls` maps a path to its async handler, `now`
    a path to a handler answered in place (the health check)."""

    def __init__(self, calls: dict[bytes, Unary], now: dict[bytes, Callable[[bytes], bytes]],
                 connections: set[GrpcProtocol]) -> None:
        self.calls, self.now, self.connections = calls, now, connections
        self.conn = h2.connection.H2Connection(config=_CONFIG)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.pending: dict[int, bytes] = {}  # answers waiting for the client's flow-control window
        self.closing = False
        self.flush_due = False  # answers made in this turn of the loop go out in one write

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(self)
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        })
        self.conn.initiate_connection()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        self.streams.clear()
        self.pending.clear()

    def pause_writing(self) -> None:  # a client not reading its answers: stop reading its calls
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued its GOAWAY
            log.info("RLS connection closed: HTTP/2 protocol error: %s", exc)
            self._flush()
            self._close()
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self._request(event.stream_id, event.headers, event.stream_ended is not None)
            elif isinstance(event, h2.events.DataReceived):
                self._data(event)
            elif isinstance(event, h2.events.StreamEnded):
                self._ended(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self._forget(event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                self._send_pending()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._flush()
                self._close()
                return
        self._flush()

    def _request(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        method = path = content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
        grpc = content_type == b"application/grpc" or content_type.startswith((b"application/grpc+",
                                                                              b"application/grpc;"))
        if method != b"POST" or not grpc:
            # not gRPC: HTTP's answer (the gRPC spec's 415 for a foreign content type)
            self.conn.send_headers(stream_id, [(b":status", b"415" if method == b"POST" else b"405")],
                                   end_stream=True)
            self._drop(stream_id)
            return
        if path not in self.calls and path not in self.now:
            self._error(stream_id, UNIMPLEMENTED, f"unknown method {path.decode('latin-1')[:200]}")
            self._drop(stream_id)
            return
        self.streams[stream_id] = _Stream(path)
        if ended:
            self._ended(stream_id)

    def _data(self, event: h2.events.DataReceived) -> None:
        stream_id = event.stream_id
        if event.flow_controlled_length:
            self.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
        stream = self.streams.get(stream_id)
        if stream is None or stream.refused:
            return
        stream.body += event.data
        if len(stream.body) > MAX_MESSAGE + 5:
            stream.refused = True
            stream.body = bytearray()
            self._error(stream_id, RESOURCE_EXHAUSTED, f"a message may be at most {MAX_MESSAGE} bytes")

    def _ended(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None or stream.refused:
            return
        body = bytes(stream.body)
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            self._error(stream_id, INVALID_ARGUMENT, "the body must be exactly one length-prefixed message")
            return
        if body[0] != 0:
            self._error(stream_id, UNIMPLEMENTED, "compressed messages are not accepted (grpc-encoding identity)")
            return
        message = body[5:]
        answer_now = self.now.get(stream.method)
        if answer_now is not None:
            try:
                self._answer(stream_id, answer_now(message))
            except GrpcError as exc:
                self._error(stream_id, exc.status, exc.message)
            return
        task = asyncio.get_running_loop().create_task(self._call(stream_id, self.calls[stream.method], message))
        self.tasks[stream_id] = task

    async def _call(self, stream_id: int, handler: Unary, message: bytes) -> None:
        try:
            answer = await handler(message)
        except GrpcError as exc:
            self._error(stream_id, exc.status, exc.message)
        except Exception:
            log.exception("RLS call failed")
            self._error(stream_id, INTERNAL, "the gateway failed to answer the call")
        else:
            self._answer(stream_id, answer)
        finally:
            self.tasks.pop(stream_id, None)
        if not self.flush_due:  # the calls of one Redis batch end in one turn: one write for them all
            self.flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_later)
        if self.closing and not self.tasks:
            self._flush()
            self._close()

    def _answer(self, stream_id: int, message: bytes) -> None:
        frame = b"\0" + len(message).to_bytes(4, "big") + message
        try:
            self.conn.send_headers(stream_id, _RESPONSE_HEAD)
            if self.conn.local_flow_control_window(stream_id) < len(frame) or self.pending:
                self.pending[stream_id] = frame
                return
            self.conn.send_data(stream_id, frame)
            self.conn.send_headers(stream_id, _OK_TRAILERS, end_stream=True)
        except h2.exceptions.StreamClosedError:
            pass  # the client reset it meanwhile

    def _send_pending(self) -> None:
        for stream_id, frame in list(self.pending.items()):
            try:
                if self.conn.local_flow_control_window(stream_id) < len(frame):
                    return
                self.conn.send_data(stream_id, frame)
                self.conn.send_headers(stream_id, _OK_TRAILERS, end_stream=True)
            except h2.exceptions.StreamClosedError:
                pass
            del self.pending[stream_id]

    def _error(self, stream_id: int, status: int, message: str) -> None:
        """A trailers-only answer: the status and its message (percent-encoded, gRPC's rule)."""
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.send_headers(stream_id, [*_RESPONSE_HEAD, (b"grpc-status", str(status).encode()),
                                               (b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[]^_`{|}~")
                                                .encode())], end_stream=True)

    def _drop(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def _forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self.pending.pop(stream_id, None)
        task = self.tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _flush_later(self) -> None:
        self.flush_due = False
        self._flush()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def drain(self) -> None:
        """Stop taking calls (GOAWAY); close once the calls in flight are answered."""
        self.closing = True
        self.conn.close_connection()
        self._flush()
        if not self.tasks:
            self._close()


class GrpcServer:
    """The listening RLS socket of one worker and its connections."""

    def __init__(self, calls: dict[bytes, Unary], now: dict[bytes, Callable[[bytes], bytes]]) -> None:
        self.calls, self.now = calls, now
        self.connections: set[GrpcProtocol] = set()
        self.server: asyncio.Server | None = None

    async def start(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: GrpcProtocol(self.calls, self.now, self.connections), sock=sock,
                                               ssl=tls)

    async def stop(self, timeout: float) -> None:
        """Stop listening, send GOAWAY on every connection, wait up to `timeout` for the calls in flight."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.drain()
        waited = 0.0
        while self.connections and waited < timeout:
            await asyncio.sleep(0.05)
            waited += 0.05
        for connection in list(self.connections):
            connection._close()



