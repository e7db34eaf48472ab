"""The lean upstream transport: HTTP/1.1 (plain or TLS) behind httpx's transport interface.

`LeanTransport` is an `httpx.AsyncBaseTransport`: it takes an `httpx.Request` and returns an
`httpx.Response` whose stream hands body chunks over as they arrive, like httpx's own
`AsyncHTTPTransport` (which the gateway uses for `http2: true` upstreams, and which runs through
the same tests: tests/test_http_transport.py and tests/conformance/). Underneath: keep-alive
connections on asyncio protocols and llhttp (httptools) as the response parser, the head written
in one `write()`, the upstream socket paused while the client reads slower than the upstream
sends. It costs a fraction of httpcore's per-request CPU (docs/benchmarks.md, "The price of each
library").

Framing is strict: exactly one response is read per request; bytes after its end
close the connection and are never read as a response; a response head over `MAX_HEAD_BYTES`, a
transfer-coding other than chunked, or Content-Length with Transfer-Encoding is an invalid
response; trailers never become headers; a connection whose request body was not sent whole is
never reused, nor one whose answer has no body by its framing (HEAD, 204, 304) while its head
announces one (a body sent anyway would come late, as the next request's answer). The request's
framing is the caller's: its Content-Length or `Transfer-Encoding: chunked` header says how the
body is sent.

Upgrades: a request that carries `Upgrade` and `Connection: upgrade` may be answered 101; the
response then has httpcore's `network_stream` extension (an `UpgradedStream`, gateway/http/upgraded.py)
holding whatever the upstream sent after the head, and its connection leaves the pool: no longer
counted against `max_connections`, never reused, closed by whoever holds the stream. A 101 to any
other request is an invalid response.

Errors leave as httpx's own exception types (ConnectError, ConnectTimeout, PoolTimeout,
ReadTimeout, RemoteProtocolError, WriteError), so the caller converts one family at one edge.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from gateway.config import Upstream
from gateway.http.upgraded import UpgradedStream

READ_HIGH_WATER = 256 * 1024  # response bytes held for a slow client before the upstream is paused
IDLE_TIMEOUT = 15.0           # an idle keep-alive connection is closed after this long unused
MAX_HEAD_BYTES = 64 * 1024    # status line and header fields of one response
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
_HTTP11 = {"http_version": b"HTTP/1.1"}


class _Trailing(Exception):
    """Raised inside the parser to stop at the end of the one response a request gets."""


class Connection(asyncio.Protocol):
    """One upstream connection, one request at a time.

    Per request: `begin()` writes the head; `head` resolves when the response head has arrived;
    `read()` returns body bytes as they come and b"" at the end; `finish()` says whether the
    connection may carry another request.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.retired = False             # no longer counted against the pool's limit
        self.served = 0                  # responses completed on this connection
        self.idle_since = 0.0
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timeout = 0.0
        self.upgrading = False           # the request asks to switch protocols: a 101 is its answer
        self.tunnel: UpgradedStream | None = None  # switched: bytes go here, never to the parser
        self._reset()

    def _reset(self) -> None:
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.keep_alive = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_only = False           # a HEAD request: the response has no body, whatever it says
        self.framed = False              # Content-Length or chunked: the end is in the data
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.body_waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.got_bytes = False
        self.error: BaseException | None = None
        self.read_paused = False
        self.last_activity = 0.0
        self.head_bytes = 0              # bytes received while the response head is incomplete
        self.field_bytes = 0             # name + value + 4 per field of the response head
        self.body_delivered = 0          # body bytes the parser has handed over
        self.framing_bytes = 0           # bytes read since the last body bytes (framing, trailers)
        self.sending_body = False        # the request body is still being sent upstream
        self.trailing = False            # bytes came after the response: never reused

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel.feed(data)
            return
        if self.head is None:  # nothing asked: an idle connection must not speak
            self.close()
            return
        self.got_bytes = True
        self.last_activity = self.loop.time()
        if self.status == 0:
            self.head_bytes += len(data)  # a head trickling in: bounded whatever the packets
        delivered = self.body_delivered
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if self.upgrading and self.status == 101:
                self._switch(data[exc.args[0]:] if exc.args and isinstance(exc.args[0], int) else b"")
            else:
                self.fail(httpx.RemoteProtocolError(f"upstream '{self.pool.name}' switched protocols"))
        except httptools.HttpParserError as exc:
            if self.trailing:
                self.close()  # the response itself is whole; what followed it is never read
            else:
                self.fail(httpx.RemoteProtocolError(f"upstream '{self.pool.name}' sent an invalid response: {exc}"))
            return
        if self.status == 0 and self.head_bytes > MAX_HEAD_BYTES:
            self.fail(httpx.RemoteProtocolError(
                f"upstream '{self.pool.name}' sent a response head over {MAX_HEAD_BYTES // 1024} KiB"))
        elif self.status and not self.complete:
            # reads with no body bytes are chunk framing or trailers: bounded like a head
            self.framing_bytes = self.framing_bytes + len(data) if self.body_delivered == delivered else 0
            if self.framing_bytes > MAX_HEAD_BYTES:
                self.fail(httpx.RemoteProtocolError(
                    f"upstream '{self.pool.name}' sent chunk framing or trailers over {MAX_HEAD_BYTES // 1024} KiB"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.tunnel is not None:
            self.tunnel.end()
        elif self.head is None:
            self.pool.forget(self)
        elif not self.complete:
            if self.head.done() and not self.framed and self.error is None:
                self._completed()  # a body delimited by the end of the connection
            else:
                self.fail(httpx.RemoteProtocolError(
                    f"upstream '{self.pool.name}' closed the connection before the response ended"
                ))
        self._wake_drain(ConnectionResetError("upstream connection closed"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain(None)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # A second response in the same read: never merged into the first, never kept for
            # the next request. Parsing stops here and the connection is closed after this one.
            self.trailing = True
            raise _Trailing()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:
            return  # a trailer field of a chunked response: never a header
        self.field_bytes += len(name) + len(value) + 4
        if self.field_bytes > MAX_HEAD_BYTES:
            raise httptools.HttpParserError("response head too large")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200 and not (status == 101 and self.upgrading):
            self.headers = []  # 1xx: informational, the real answer follows
            self.field_bytes = 0
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message ends
        lengths = codings = 0
        announced = False  # the head announces a body (a length other than 0, or a transfer-coding)
        for name, value in self.headers:
            if name == b"content-length":
                lengths += 1
                self.framed = True
                announced = announced or value.strip() != b"0"
            elif name == b"transfer-encoding":
                codings += 1
                if value.strip().lower() != b"chunked":
                    raise httptools.HttpParserError(f"transfer-coding {value[:40]!r} is not supported")
                self.framed = True
        if codings and lengths:
            raise httptools.HttpParserError("both Content-Length and Transfer-Encoding")
        if status in (204, 304) or self.head_only:
            self.framed = True
            if announced or codings:
                # No body by its framing, yet the head announces one: an upstream that sends it
                # anyway sends it after the answer ended, possibly after another request was
                # written, which would read it as its answer. Never reused.
                self.keep_alive = False
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)
        if self.head_only:
            self._completed()

    def on_body(self, body: bytes) -> None:
        self.body_delivered += len(body)
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if (self.buffered > READ_HIGH_WATER and not self.read_paused and self.transport is not None
                and not self.closed):
            self.read_paused = True
            self.transport.pause_reading()
        self._wake_body()

    def on_message_complete(self) -> None:
        if self.status == 0 or self.complete:
            return  # the end of a 1xx, or of a HEAD answer's announced body that never comes
        self._completed()

    # --- one request ---------------------------------------------------------------------------

    def begin(self, head: bytes, head_only: bool, timeout: float, upgrading: bool = False) -> None:
        self._reset()
        self.head_only = head_only
        self.upgrading = upgrading
        self.head = self.loop.create_future()
        self.last_activity = self.loop.time()
        self.timeout = timeout
        if self.timer is None:  # armed once and kept while requests follow each other
            self.timer = self.loop.call_later(timeout, self._check_timeout)
        assert self.transport is not None
        self.transport.write(head)

    def write(self, data: bytes) -> None:
        self.last_activity = self.loop.time()
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("upstream connection closed")
        if self.write_paused:
            self.drain_waiter = self.loop.create_future()
            await self.drain_waiter

    def take_chunks(self) -> bytes:
        """The body bytes received so far (at least one chunk is there); reading resumes."""
        if len(self.chunks) == 1:
            data = self.chunks.popleft()
        else:
            data = b"".join(self.chunks)
            self.chunks.clear()
        self.buffered = 0
        self.last_activity = self.loop.time()
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            if not self.closed:
                self.transport.resume_reading()
        return data

    def finish(self) -> bool:
        """Ends the request; True if the connection can carry another one."""
        # a connection that asked to switch protocols and was answered otherwise is never reused:
        # the upstream may have switched its side all the same (the next client's request
        # went to a connection in that state)
        reusable = (self.complete and self.error is None and not self.closed and self.keep_alive
                    and not self.trailing and not self.upgrading)
        if reusable and self.head_only:
            self.parser = httptools.HttpResponseParser(self)  # it still expects the announced body
        self.head = None
        self.chunks.clear()
        if reusable:
            self.served += 1
        return reusable

    def fail(self, error: BaseException) -> None:
        """Ends the request with `error` and the connection with it."""
        if self.error is None and not self.complete:
            self.error = error
            head = self.head
            if head is not None and not head.done():
                head.set_exception(error)
            self._wake_body()
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()

    def _switch(self, early: bytes) -> None:
        """A 101 to an upgrade: from now on the connection is raw bytes, read by the stream's holder."""
        assert self.transport is not None, "bytes came from it"
        self.tunnel = UpgradedStream(self, self.transport, self.loop, READ_HIGH_WATER)
        self.tunnel.feed(early)
        if self.timer is not None:  # the upstream's read timeout no longer applies: the tunnel's idle one does
            self.timer.cancel()
            self.timer = None

    # gateway.http.upgraded.Side
    def pause_side(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_side(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    async def writable(self, written: int) -> None:
        await self.drain()

    def _completed(self) -> None:
        self.complete = True
        self._wake_body()

    def _check_timeout(self) -> None:
        self.timer = None
        if self.head is None or self.complete or self.closed or self.tunnel is not None:
            return  # idle, or done: the next request arms it again
        quiet = self.loop.time() - self.last_activity
        if (self.sending_body and not self.complete) or self.buffered:
            # the client's body is still coming, or the client has not yet taken what the upstream
            # sent: the wait is the client's, and its own timeout applies, not the upstream's
            quiet = 0.0
        if quiet < self.timeout:
            self.timer = self.loop.call_later(self.timeout - quiet, self._check_timeout)
            return
        self.fail(httpx.ReadTimeout(f"upstream '{self.pool.name}' did not answer in time"))

    def _wake_body(self) -> None:
        waiter = self.body_waiter
        if waiter is not None:
            self.body_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _wake_drain(self, error: BaseException | None) -> None:
        waiter = self.drain_waiter
        if waiter is not None:
            self.drain_waiter = None
            if not waiter.done():
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)


class ConnectionPool:
    """At most `max_connections` connections to one upstream, idle ones reused newest first."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.name = upstream.name
        parts = urlsplit(upstream.url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = tls_context(upstream) if parts.scheme == "https" else None
        self.limit = upstream.max_connections
        self.loop = asyncio.get_running_loop()
        self.idle: list[Connection] = []
        self.open = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def take_idle(self) -> Connection | None:
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TIMEOUT:
                return conn
            self._retire(conn)
        return None

    async def connect(self) -> Connection:
        """A new connection, waiting for a free slot first if all are in use."""
        deadline = self.loop.time() + self.upstream.connect_timeout
        while self.open >= self.limit:
            idle = self.take_idle()
            if idle is not None:
                return idle
            waiter: asyncio.Future[None] = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(deadline - self.loop.time(), 0))
            except TimeoutError:
                raise httpx.PoolTimeout(
                    f"upstream '{self.name}': all {self.limit} connections stayed busy"
                ) from None
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
        self.open += 1
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.ssl,
                                            server_hostname=self.host if self.ssl else None),
                max(deadline - self.loop.time(), 0.001),
            )
        except TimeoutError:
            self._slot_freed()
            raise httpx.ConnectTimeout(f"upstream '{self.name}' did not accept a connection in time") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._slot_freed()
            raise httpx.ConnectError(f"upstream '{self.name}' unreachable: {exc.__class__.__name__}") from None
        except BaseException:
            self._slot_freed()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the pool if it can carry another request, else closed."""
        if conn.finish() and not self._closed:
            conn.idle_since = self.loop.time()
            self.idle.append(conn)
            self._wake_one()
        else:
            conn.close()
            self._retire(conn)

    def detach(self, conn: Connection) -> None:
        """A connection that switched protocols: no longer the pool's to count or reuse."""
        self._retire(conn)

    def forget(self, conn: Connection) -> None:
        """An idle connection the upstream closed."""
        if conn in self.idle:
            self.idle.remove(conn)
            self._retire(conn)

    def close(self) -> None:
        self._closed = True
        for conn in self.idle:
            conn.close()
            self._retire(conn)
        self.idle.clear()

    def _retire(self, conn: Connection) -> None:
        if conn.retired:
            return
        conn.retired = True
        self._slot_freed()

    def _slot_freed(self) -> None:
        self.open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return




class LeanTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over `ConnectionPool`, for one plain-HTTP/1.1 upstream."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.pool: ConnectionPool | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self.pool
        if pool is None:
            pool = self.pool = ConnectionPool(self.upstream)
        method = request.method.encode("ascii")
        raw_headers = request.headers.raw
        length = -1
        chunked = upgrade = connection_upgrade = False
        for name, value in raw_headers:  # one pass over the fields, not httpx's lookups
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"transfer-encoding":
                chunked = True
            elif lowered == b"upgrade":
                upgrade = True
            elif lowered == b"connection":
                connection_upgrade = b"upgrade" in value.lower()
        has_body = chunked or length > 0
        target = request.extensions.get("target") or request.url.raw_path  # as httpcore reads it
        head = _request_head(method, target, raw_headers)
        head_only = method == b"HEAD"
        upgrading = upgrade and connection_upgrade
        timeout = _read_timeout(request, self.upstream.timeout)
        while True:
            conn = pool.take_idle() or await pool.connect()
            conn.begin(head, head_only, timeout, upgrading)
            sender = None
            if has_body:
                conn.sending_body = True
                sender = asyncio.ensure_future(_send_body(conn, request.stream, chunked, length))
            try:
                await conn.head  # type: ignore[misc]
            except BaseException as exc:
                if sender is not None and not sender.done():
                    sender.cancel()
                conn.close()
                pool.release(conn)
                if sender is not None and sender.done() and not sender.cancelled():
                    failure = sender.exception()
                    if failure is not None and not isinstance(failure, httpx.TransportError):
                        raise failure from None  # the client's side failed first (e.g. it went away)
                if (isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError) and conn.served > 0
                        and not conn.got_bytes and not has_body and method in IDEMPOTENT):
                    continue  # the upstream closed a kept-alive connection as we reused it: once more
                raise
            break
        if conn.status == 101:
            if sender is not None and not sender.done():
                sender.cancel()
            if conn.tunnel is None:  # a 101 llhttp did not read as a switch: no tunnel to hand over
                conn.close()
                pool.release(conn)
                raise httpx.RemoteProtocolError(f"upstream '{pool.name}' answered 101 without switching protocols")
            pool.detach(conn)
            return httpx.Response(101, headers=conn.headers, stream=httpx.ByteStream(b""),
                                  extensions={**_HTTP11, "network_stream": conn.tunnel})
        if conn.complete and conn.error is None and (sender is None or sender.done()):
            # The whole response came with its head (the common small answer): the connection goes
            # back to the pool now, and the body is handed over in memory, as httpx.ByteStream.
            if sender is not None and not sender.cancelled():
                sender.exception()  # a body that failed after the whole answer came only ends the connection
            status, headers = conn.status, conn.headers
            body = conn.take_chunks() if conn.chunks else b""
            pool.release(conn)
            return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body), extensions=_HTTP11)
        return httpx.Response(conn.status, headers=conn.headers, stream=_ResponseStream(pool, conn, sender),
                              extensions=_HTTP11)

    async def aclose(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, pool: ConnectionPool, conn: Connection, sender: asyncio.Future[None] | None) -> None:
        self.pool = pool
        self.conn = conn
        self.sender = sender
        self.released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            while not conn.chunks:
                if conn.error is not None:
                    error = conn.error
                    if isinstance(error, httpx.TransportError):
                        raise error
                    raise httpx.ReadError(f"upstream '{self.pool.name}' response broke off") from error
                if conn.complete:
                    return
                conn.body_waiter = conn.loop.create_future()
                await conn.body_waiter
            yield conn.take_chunks()

    async def aclose(self) -> None:
        if self.released:
            return
        self.released = True
        sender = self.sender
        if sender is not None and not sender.done():
            sender.cancel()  # answered before the whole body was sent: the connection goes
            self.conn.close()
        elif not self.conn.complete:
            self.conn.close()  # the caller stopped reading: what is left is never read as a response
        self.pool.release(self.conn)


async def _send_body(conn: Connection, stream: Any, chunked: bool, length: int) -> None:
    try:
        await _stream_body(conn, stream, chunked, length)
    finally:
        conn.sending_body = False
        conn.last_activity = conn.loop.time()  # the upstream's time to answer starts now


async def _stream_body(conn: Connection, stream: Any, chunked: bool, length: int) -> None:
    sent = 0
    try:
        async for chunk in stream:
            if not chunk:
                continue
            sent += len(chunk)
            if not chunked and sent > length:
                raise httpx.LocalProtocolError("request body longer than its Content-Length")
            conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            if conn.write_paused:
                await conn.drain()
        if chunked:
            conn.write(b"0\r\n\r\n")
        elif sent != length:
            raise httpx.LocalProtocolError("request body shorter than its Content-Length")
    except OSError as exc:
        error = httpx.WriteError(f"upstream '{conn.pool.name}' stopped taking the request body: {exc}")
        conn.fail(error)
        raise error from None
    except BaseException as exc:
        conn.fail(exc)  # the connection is owed bytes it will never get: it is never reused
        raise


def tls_context(upstream: Upstream) -> ssl.SSLContext:
    """The client side of TLS to an upstream: its `tls:` CAs, client certificate and verification."""
    tls = upstream.tls
    context = ssl.create_default_context(cafile=tls.ca if tls else None)
    if tls is not None:
        if not tls.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if tls.cert and tls.key:
            context.load_cert_chain(tls.cert, tls.key)
    return context


def _read_timeout(request: httpx.Request, default: float) -> float:
    timeout = request.extensions.get("timeout")
    if isinstance(timeout, dict) and timeout.get("read") is not None:
        return float(timeout["read"])
    return default


def _request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    parts: list[bytes] = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
