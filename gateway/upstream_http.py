"""HTTP/1.1 to one upstream: keep-alive connections on asyncio protocols, httptools' response parser.

This is the forwarding path's client. aiohttp's client did the same job with more layers (a
session, a connector, a request and a response object, a stream reader, timers per read) and was
41% of the gateway's CPU under load (docs/benchmarks.md); this one writes the request head in one
`write()`, parses the answer with llhttp through httptools, and hands body chunks to the caller as
they arrive, pausing the upstream socket while the client is slower than the upstream.

Errors leave here as `UpstreamUnavailable` (502) or `UpstreamTimeout` (504) before the response
head, and as `ResponseAborted` after it (the caller ends the client connection).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

from gateway.config import Upstream
from gateway.errors import UpstreamTimeout, UpstreamUnavailable

READ_HIGH_WATER = 256 * 1024  # response bytes held for a slow client before the upstream is paused
IDLE_TIMEOUT = 15.0           # an idle keep-alive connection is closed after this long unused
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})


class ResponseAborted(Exception):
    """The upstream failed after the response head was sent on: the body is incomplete."""


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

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # nothing asked: an idle connection must not speak
            self.close()
            return
        self.got_bytes = True
        self.last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail(UpstreamUnavailable(f"upstream '{self.pool.name}' switched protocols, which is not supported"))
        except httptools.HttpParserError as exc:
            self.fail(UpstreamUnavailable(f"upstream '{self.pool.name}' sent an invalid response: {exc}"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head is None:
            self.pool.forget(self)
        elif not self.complete:
            if self.head.done() and not self.framed and self.error is None:
                self._completed()  # a body delimited by the end of the connection
            else:
                self.fail(UpstreamUnavailable(
                    f"upstream '{self.pool.name}' closed the connection before answering"
                ))
        self._wake_drain(ConnectionResetError("upstream connection closed"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain(None)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.headers = []  # 1xx: informational, the real answer follows
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message ends
        for name, value in self.headers:
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                self.framed = True
        if status in (204, 304):
            self.framed = True
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)
        if self.head_only:
            self.framed = True
            self._completed()

    def on_body(self, body: bytes) -> None:
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

    def begin(self, head: bytes, head_only: bool, timeout: float) -> None:
        self._reset()
        self.head_only = head_only
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

    async def read(self) -> bytes:
        """The body bytes received so far, waiting for some; b"" once the body is complete."""
        while not self.chunks:
            if self.error is not None:
                raise ResponseAborted() from self.error
            if self.complete:
                return b""
            self.body_waiter = self.loop.create_future()
            await self.body_waiter
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
        reusable = self.complete and self.error is None and not self.closed and self.keep_alive
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

    def _completed(self) -> None:
        self.complete = True
        self._wake_body()

    def _check_timeout(self) -> None:
        self.timer = None
        if self.head is None or self.complete or self.closed:
            return  # idle, or done: the next request arms it again
        quiet = self.loop.time() - self.last_activity
        if quiet < self.timeout:
            self.timer = self.loop.call_later(self.timeout - quiet, self._check_timeout)
            return
        self.fail(UpstreamTimeout(f"upstream '{self.pool.name}' did not answer in time"))

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
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        default_port = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default_port
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if self.port == default_port else f"{host}:{self.port}").encode("idna")
        self.path_prefix = parts.path.rstrip("/").encode()
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
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
                raise UpstreamTimeout(
                    f"upstream '{self.name}': all {self.limit} connections stayed busy"
                ) from None
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
        self.open += 1
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                max(deadline - self.loop.time(), 0.001),
            )
        except TimeoutError:
            self._slot_freed()
            raise UpstreamTimeout(f"upstream '{self.name}' did not accept a connection in time") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._slot_freed()
            raise UpstreamUnavailable(f"upstream '{self.name}' unreachable: {exc.__class__.__name__}") from None
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


def request_head(pool: ConnectionPool, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 chunked: bool) -> bytes:
    parts: list[bytes] = [method, b" ", pool.path_prefix, target, b" HTTP/1.1\r\nhost: ", pool.host_header, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
