"""The RLS port's gRPC server: unary calls over HTTP/2 cleartext.

The HTTP/2 engine (gateway/rls/http2.py: libnghttp2 through ngh2; h2 as the comparison) does the
framing, HPACK, flow control, SETTINGS, PING and GOAWAY; this file adds what gRPC puts on top for
unary calls: the path names the method, the body is one length-prefixed message, the status goes in
trailers. Chosen by measurement over h2, grpcio's asyncio server and grpclib (docs/benchmarks.md,
"Behind Envoy"), which tests/support/rls_comparison.py runs through the same tests.

Bounds, each with a test (tests/test_rls_server.py):
- per worker MAX_CONNECTIONS connections (more are closed at once);
- per connection MAX_STREAMS streams at once (more: h2's REFUSED_STREAM), 16 KiB of request
  headers, MAX_BUFFERED bytes of bodies not yet ended (more: GOAWAY ENHANCE_YOUR_CALM), and resets
  without a call answered beyond MAX_RESETS (the HTTP/2 rapid reset: GOAWAY ENHANCE_YOUR_CALM);
- per call one message of at most MAX_MESSAGE bytes (more: RESOURCE_EXHAUSTED, nothing counted),
  no compression (UNIMPLEMENTED), and `body_timeout` seconds (GATEWAY_RLS_BODY_TIMEOUT) for its body
  to end (else the stream is reset);
- a connection that opens no call for `idle_timeout` seconds (GATEWAY_RLS_IDLE_TIMEOUT) while
  none is in flight is closed (`_leave`, graceful: a call already on its way is answered): PING,
  SETTINGS, WINDOW_UPDATE and the like open no call, so they never keep a connection (nor its
  slot) on their own.
A stream the client resets is cancelled, its call with it. Shutdown (`drain`): GOAWAY naming the
last stream taken, later streams refused, the calls in flight answered, then the connection closes.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import cast
from urllib.parse import quote

from gateway import tracing
from gateway.rls.http2 import (
    CANCEL,
    DATA,
    END,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    PONG,
    REFUSED_STREAM,
    REQUEST,
    RESET,
    WINDOW,
    EngineFactory,
    Headers,
    Http2Failure,
    Ngh2Engine,
)
from gateway.rls.service import (
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    GrpcError,
)
from gateway.settings import DEFAULTS

log = logging.getLogger("gateway.rls")

MAX_MESSAGE = 64 * 1024
MAX_STREAMS = 128
MAX_HEADER_LIST = 16 * 1024
MAX_BUFFERED = 1024 * 1024
MAX_CONNECTIONS = 4096
MAX_RESETS = 100          # client resets beyond twice the calls answered, and this many more
BODY_TIMEOUT = DEFAULTS.rls_body_timeout  # seconds for a call's body to end (GATEWAY_RLS_BODY_TIMEOUT)
IDLE_TIMEOUT = DEFAULTS.rls_idle_timeout  # seconds a connection may go without a call (GATEWAY_RLS_IDLE_TIMEOUT)
LEAVING_WAIT = 1.0        # an idle close: seconds the final GOAWAY waits for the client's PING ACK
_LEAVING_PING = b"rls-idle"
INTERNAL = 13
_RESPONSE_HEAD = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_OK_TRAILERS = [(b"grpc-status", b"0")]
_SAFE = " !\"#$&'()*+,-./:;<=>?@[]^_`{|}~"  # grpc-message: all else percent-encoded

Unary = Callable[[bytes], Awaitable[bytes]]


class _Stream:
    __slots__ = ("body", "context", "method", "refused", "started")

    def __init__(self, method: bytes, started: float) -> None:
        self.method = method
        self.context: tuple[bytes, bytes] | None = None  # traceparent, tracestate: with traces on only
        self.body = bytearray()
        self.refused = False  # answered already (too large): the rest of its body is dropped
        self.started = started


class GrpcProtocol(asyncio.Protocol):
    """One HTTP/2 connection of unary gRPC calls: `calls` maps a path to its async handler, `now`
    a path to a handler answered in place (the health check)."""

    def __init__(self, calls: dict[bytes, Unary], now: dict[bytes, Callable[[bytes], bytes]],
                 connections: set[GrpcProtocol], idle_timeout: float = IDLE_TIMEOUT,
                 engine: EngineFactory = Ngh2Engine, body_timeout: float = BODY_TIMEOUT) -> None:
        self.calls, self.now, self.connections = calls, now, connections
        self.idle_timeout = idle_timeout
        self.body_timeout = body_timeout
        self.conn = engine(MAX_STREAMS, MAX_HEADER_LIST)
        self.last_stream = 0  # the highest stream a call was opened on
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # answers waiting for the client's flow-control window, with when they began to wait
        self.pending: dict[int, tuple[bytes, float]] = {}
        self.buffered = 0  # bytes of bodies not yet ended, all streams together
        self.closing = False  # draining: no new call; closed once the calls in flight are answered
        self.flush_due = False  # answers made in this turn of the loop go out in one write
        self.resets = 0
        self.answered = 0
        self.active = time.monotonic()  # when the last call was opened or answered: frames alone never move it
        self.leaving: float | None = None  # when an idle close sent its first GOAWAY (`_leave`)
        # the connection's loop, kept: asyncio.get_running_loop() makes a getpid() system call each time
        self.loop = asyncio.get_running_loop()
        self.closed = self.loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        if len(self.connections) >= MAX_CONNECTIONS:
            log.warning("RLS: %d connections already: one more closed", len(self.connections))
            self.transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(self)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        self.streams.clear()
        self.pending.clear()

    def pause_writing(self) -> None:  # a client not reading its answers: stop reading its calls
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive(data)
        except Http2Failure as exc:
            log.info("RLS connection closed: HTTP/2 protocol error: %s", exc)
            self._flush()
            self._close()
            return
        for kind, stream_id, payload in events:
            if kind == DATA:
                self._data(stream_id, payload)
            elif kind == REQUEST:
                self._request(stream_id, *payload)
            elif kind == END:
                self._ended(stream_id)
            elif kind == RESET:
                self._forget(stream_id)
                self.resets += 1
                if self.resets > MAX_RESETS + 2 * self.answered:  # the rapid reset attack (CVE-2023-44487)
                    self._calm("too many streams reset")
                    return
            elif kind == WINDOW:
                self._send_pending()
            elif kind == GOAWAY:  # the client's GOAWAY: answer, then close
                self.closing = True
            elif kind == PONG and payload == _LEAVING_PING:
                self.drain()  # the client has read the first GOAWAY: what it sends now is refused
        self._flush()
        self._finish_if_drained()

    def _request(self, stream_id: int, headers: Headers, ended: bool) -> None:
        if self.closing:  # after our GOAWAY: refused, the client may retry it elsewhere
            self.conn.reset(stream_id, REFUSED_STREAM)
            return
        method = path = content_type = parent = state = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"traceparent":
                parent = value
            elif name == b"tracestate":
                state = value
        grpc = content_type == b"application/grpc" or content_type.startswith((b"application/grpc+",
                                                                              b"application/grpc;"))
        if method != b"POST" or not grpc:
            # not gRPC: HTTP's answer (the gRPC spec's 415 for a foreign content type)
            self.conn.headers(stream_id, [(b":status", b"415" if method == b"POST" else b"405")], end_stream=True)
            return
        if path not in self.calls and path not in self.now:
            self._error(stream_id, UNIMPLEMENTED, f"unknown method {path.decode('latin-1')[:200]}")
            return
        self.active = time.monotonic()
        self.last_stream = max(self.last_stream, stream_id)
        stream = self.streams[stream_id] = _Stream(path, self.active)
        if parent and tracing.ON:
            stream.context = (parent, state)
        if ended:
            self._ended(stream_id)

    def _data(self, stream_id: int, data: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or stream.refused:
            return
        stream.body += data
        self.buffered += len(data)
        if len(stream.body) > MAX_MESSAGE + 5:
            self.buffered -= len(stream.body)
            stream.refused = True
            stream.body = bytearray()
            self._error(stream_id, RESOURCE_EXHAUSTED, f"a message may be at most {MAX_MESSAGE} bytes")
        elif self.buffered > MAX_BUFFERED:
            self._calm(f"more than {MAX_BUFFERED} bytes of unfinished messages")

    def _ended(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None or stream.refused:
            return
        self.buffered -= len(stream.body)
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
        call = self._call(stream_id, self.calls[stream.method], message)
        if stream.context is None:
            task = self.loop.create_task(call)
        else:  # the call's task knows the caller's trace context (gateway/tracing.py)
            context = contextvars.copy_context()
            context.run(tracing.CALL_CONTEXT.set, stream.context)
            task = self.loop.create_task(call, context=context)
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
            self.active = time.monotonic()
        if not self.tasks:  # the last call in flight: its answer goes now
            self._flush()
            self._finish_if_drained()
        elif not self.flush_due:  # the calls of one Redis batch end in one turn: one write for them all
            self.flush_due = True
            self.loop.call_soon(self._flush_later)

    def _answer(self, stream_id: int, message: bytes) -> None:
        frame = b"\0" + len(message).to_bytes(4, "big") + message
        self.answered += 1
        conn = self.conn
        conn.headers(stream_id, _RESPONSE_HEAD)
        if conn.window(stream_id) < len(frame):
            self.pending[stream_id] = (frame, time.monotonic())
            return
        conn.data(stream_id, frame)
        conn.trailers(stream_id, _OK_TRAILERS)

    def _send_pending(self) -> None:
        for stream_id, (frame, _) in list(self.pending.items()):
            if self.conn.window(stream_id) < len(frame):
                continue  # this one waits for its window; the others need not
            self.conn.data(stream_id, frame)
            self.conn.trailers(stream_id, _OK_TRAILERS)
            del self.pending[stream_id]

    def _error(self, stream_id: int, status: int, message: str) -> None:
        """A trailers-only answer: the status and its message (percent-encoded, gRPC's rule)."""
        self.conn.headers(stream_id, [*_RESPONSE_HEAD, (b"grpc-status", str(status).encode()),
                                      (b"grpc-message", quote(message, safe=_SAFE).encode())], end_stream=True)

    def _forget(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None and not stream.refused:
            self.buffered -= len(stream.body)
        self.pending.pop(stream_id, None)
        task = self.tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()

    def _flush(self) -> None:
        data = self.conn.outbound()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _flush_later(self) -> None:
        self.flush_due = False
        self._flush()
        self._finish_if_drained()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # once what is written has gone: a client that never reads it...
            if self.transport.get_write_buffer_size():
                self.loop.call_later(self.body_timeout, self.transport.abort)  # ... has the body timeout

    def _calm(self, why: str) -> None:
        """A client past a bound: GOAWAY ENHANCE_YOUR_CALM, and the connection ends."""
        log.warning("RLS connection closed: %s", why)
        self.conn.close(ENHANCE_YOUR_CALM)
        self._flush()
        self._close()

    def drain(self) -> None:
        """Stop taking calls: GOAWAY naming the last stream taken (the connection stays open, so the
        calls in flight can still be answered); close once they are."""
        if self.closing or self.transport is None:
            self._finish_if_drained()
            return
        self.closing = True
        self.conn.drain(self.last_stream)
        self._flush()
        self._finish_if_drained()

    def _finish_if_drained(self) -> None:
        if self.closing and not self.tasks and not self.pending and not self.streams:
            self.conn.close()
            self._flush()
            self._close()

    def sweep(self, now: float) -> None:
        """The timeouts: a call's body that does not end, an answer the client opens no window for
        (both the body timeout: a client that never sends WINDOW_UPDATE, or whose connection
        libnghttp2 has ended for a protocol error, held it for good), a connection that opens no
        call. An answer waiting for the client's window does not keep the connection."""
        for stream_id, stream in list(self.streams.items()):
            if now - stream.started > self.body_timeout:
                self._forget(stream_id)
                self.conn.reset(stream_id, CANCEL)
                self._flush()  # before a GOAWAY below: libnghttp2 sends nothing after one that closes
        for stream_id, (_, since) in list(self.pending.items()):
            if now - since > self.body_timeout:
                del self.pending[stream_id]
                self.conn.reset(stream_id, CANCEL)
                self._flush()
        if self.leaving is not None and now - self.leaving >= LEAVING_WAIT:
            self.drain()
        elif self.leaving is None and not self.tasks and not self.streams and now - self.active > self.idle_timeout:
            self._leave(now)
            return
        self._flush()
        self._finish_if_drained()

    def _leave(self, now: float) -> None:
        """An idle connection's close, graceful as RFC 9113 6.8 has it: a GOAWAY naming the largest
        stream id, so that a call the client sent before reading it is still taken, and a PING; at
        its ACK (or after LEAVING_WAIT) `drain`: the final GOAWAY, naming the last call taken, and
        the end once the calls are answered."""
        if self.transport is None or self.transport.is_closing():
            return
        self.leaving = now
        self.conn.notice(_LEAVING_PING)
        self._flush()


class GrpcServer:
    """The listening RLS socket of one worker and its connections."""

    def __init__(self, calls: dict[bytes, Unary], now: dict[bytes, Callable[[bytes], bytes]],
                 idle_timeout: float = IDLE_TIMEOUT, engine: EngineFactory = Ngh2Engine,
                 body_timeout: float = BODY_TIMEOUT) -> None:
        self.calls, self.now = calls, now
        self.idle_timeout = idle_timeout
        self.body_timeout = body_timeout
        self.engine = engine  # the HTTP/2 under it (gateway/rls/http2.py); h2 in the comparisons only
        self.connections: set[GrpcProtocol] = set()
        self.server: asyncio.Server | None = None
        self.sweeper: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: GrpcProtocol(self.calls, self.now, self.connections,
                                                                    self.idle_timeout, self.engine,
                                                                    self.body_timeout),
                                               sock=sock, ssl=tls)
        self.sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for connection in list(self.connections):
                connection.sweep(now)

    async def stop(self, timeout: float) -> None:
        """Stop listening, send GOAWAY on every connection, wait up to `timeout` for the calls in flight."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.drain()
        waiting = [connection.closed for connection in self.connections]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)
        for connection in list(self.connections):
            connection._close()
        if self.sweeper is not None:
            self.sweeper.cancel()
