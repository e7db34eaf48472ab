"""One request and its response on a client connection: the ASGI `receive` and `send` of one app
call (`Exchange`), and the response head it writes. The connection it arrives on is
gateway/http/server.py's protocol; an exchange uses only what `Connection` lists of it."""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, Protocol

from gateway.http.flow_control import READ_HIGH_WATER, FlowControl
from gateway.http.problem import problem
from gateway.http.upgraded import Side, UpgradedStream

ASGI = {"version": "3.0", "spec_version": "2.3"}
UPGRADE = "gateway.upgrade"  # the ASGI extension that hands the client's connection over after a 101

Headers = list[tuple[bytes, bytes]]


class Connection(Side, Protocol):
    """What an exchange uses of its client connection."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    flow: FlowControl
    upgraded: bool  # an Upgrade head was read
    early: bytes  # bytes after the Upgrade head, until the app accepts it
    tunnel: UpgradedStream | None

    def response_done(self, exchange: Exchange) -> None: ...


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())
    return line


def head_lines(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A response's status line and header lines, without the empty line that ends the head."""
    parts = [_status_line(status)]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    return b"".join(parts)


def _chunk(body: bytes, more: bool) -> bytes:
    """`body` as a chunk of a chunked body (none when empty), and the last chunk unless `more`."""
    return (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")


def problem_bytes(status: int, detail: str) -> bytes:
    """A problem answer after which the connection ends."""
    status, headers, body = problem(status, detail)
    return head_lines(status, [*headers, (b"connection", b"close")]) + b"\r\n" + body


class Exchange:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = (
        "bodiless", "body", "chunked", "conn", "disconnected", "drained", "entered", "expect_100", "gone", "keep_alive",
        "left", "more_body", "pending_head", "receiving", "refused", "response_complete", "response_started",
        "scope", "task",
    )

    def __init__(self, conn: Connection, scope: dict[str, Any], keep_alive: bool, expect_100: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.body = b""
        self.more_body = True
        self.drained = False  # the body's last message went to the app: what it receives next is the end
        self.receiving: asyncio.Future[None] | None = None
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.pending_head = b""
        self.chunked = False
        self.bodiless = False
        self.left = -1  # bytes of body still owed under Content-Length (-1: not fixed)
        self.entered = False  # the app has been called: the request may have been counted and forwarded
        self.refused = False  # the parser refused it before the app was entered: the app never will be
        self.task: asyncio.Task[None] | None = None  # the app's call, once started
        self.gone = False  # the client closed the connection mid-request: its call was cancelled

    def wake(self) -> None:
        waiter = self.receiving
        if waiter is not None:
            self.receiving = None
            if not waiter.done():
                waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.expect_100 and not self.disconnected and not self.response_started:
            self.expect_100 = False
            conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self.body and self.more_body and not self.disconnected and not self.response_complete:
            conn.flow.resume_reading()
            self.receiving = conn.loop.create_future()
            await self.receiving
        while self.drained and not self.disconnected and not self.response_complete:
            # the whole body was received: the next message is the client's going (ASGI), however
            # long that takes (Starlette's streaming responses listen for it while they send)
            self.receiving = conn.loop.create_future()
            await self.receiving
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body, self.body = self.body, b""
        self.drained = not self.more_body
        conn.flow.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        flow = conn.flow
        if flow.write_paused and not self.disconnected:
            try:
                await flow.drain()
            except ConnectionResetError:  # cut for taking nothing: connection_lost cancels the call
                return
        if self.disconnected or self.response_complete:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {message['type']!r}")
            self.response_started = True
            self.expect_100 = False
            self.pending_head = self._head(message["status"], message.get("headers", ()))
            return
        if message["type"] != "http.response.body":
            raise RuntimeError(f"expected http.response.body, got {message['type']!r}")
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.bodiless:
            body = b""  # HEAD, 204, 304: whatever the app sends, no body goes out
        elif self.left >= 0:
            if len(body) > self.left:
                raise RuntimeError("response body longer than its Content-Length")
            self.left -= len(body)
        data = _chunk(body, more) if self.chunked else body
        if self.pending_head:
            data, self.pending_head = self.pending_head + data, b""
        if data:
            conn.transport.write(data)
            if more and flow.took_nothing(len(data)):
                flow.cut()
                return
        if not more:
            if self.left > 0:
                raise RuntimeError("response body shorter than its Content-Length")
            self.response_complete = True
            self.wake()  # a receive() waiting for the client's going ends with the answer
            conn.response_done(self)

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole answer (a door's), framed as `send` frames it, written at once."""
        if self.disconnected or self.response_complete or self.response_started:
            return
        self.response_started = True
        self.expect_100 = False
        head = self._head(status, headers)
        if self.bodiless:
            body = b""
        elif self.left >= 0 and len(body) != self.left:
            raise RuntimeError("response body and its Content-Length differ")
        elif self.chunked:
            body = _chunk(body, False)
        self.left = -1
        self.conn.transport.write(head + body)
        self.response_complete = True
        self.wake()
        self.conn.response_done(self)

    async def accept_upgrade(self, headers: Headers) -> UpgradedStream:
        """Switch protocols: 101 with `headers`, then the client's connection as raw bytes."""
        conn = self.conn
        if self.response_started or self.disconnected or not conn.upgraded or conn.transport.is_closing():
            raise ConnectionResetError("the client connection cannot switch protocols")
        self.response_started = True
        self.expect_100 = False
        tunnel = conn.tunnel = UpgradedStream(conn, conn.transport, conn.loop, READ_HIGH_WATER)
        conn.transport.write(head_lines(101, headers) + b"\r\n")
        early, conn.early = conn.early, b""
        tunnel.feed(early)
        conn.flow.resume_reading()
        return tunnel

    def _head(self, status: int, headers: Any) -> bytes:
        parts = [_status_line(status)]
        fixed = chunked = close = False
        old_client = self.scope["http_version"] == "1.0"
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length":
                if not fixed and not chunked:
                    fixed = True
                    self.left = int(value)
            elif lowered == b"transfer-encoding":
                chunked = value.lower() == b"chunked"
                self.left = -1
                if old_client:
                    continue  # an HTTP/1.0 client never receives a transfer-coding (RFC 9112 6.1)
            elif lowered == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                close = True
            parts += (name, b": ", value, b"\r\n")
        if status == 408:
            self.keep_alive = False  # the request's body is in doubt: the connection ends (RFC 9110 15.5.9)
        if self.scope["method"] == "HEAD" or status in (204, 304):
            self.bodiless = True
            self.left = -1
            self.chunked = False
        elif old_client and not fixed:
            self.chunked = False  # the body ends with the connection, as HTTP/1.0 delimits it
            self.keep_alive = False
        elif not fixed and not chunked:
            self.chunked = chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            self.chunked = chunked
        if not self.keep_alive and not close:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)
