"""Streams one admitted request to its upstream and the answer back, in constant memory.

Every forwarded request is an `httpx.Request` handed to the upstream's httpx transport, and every
answer an `httpx.Response` whose stream is passed on chunk by chunk. The transport is httpx's own
`AsyncHTTPTransport` for `http2: true` upstreams, and `LeanTransport` (gateway/http/transport.py)
for HTTP/1.1, plain or TLS — the same interface, the same tests.

The gateway writes the framing of what it forwards: the request's Host, Content-Length or
`Transfer-Encoding: chunked`, and X-Forwarded-*; the exact request target (the normalized path the
route matched) goes in httpx's `target` extension, so no URL library re-quotes it.

A WebSocket handshake (`request.upgrade`) is forwarded with `Upgrade: websocket` and
`Connection: upgrade` (the Sec-WebSocket-* fields are end-to-end and go as sent); a 101 answer is
handed to `switched` with its headers and its `network_stream`, and the call returns when the
tunnel has closed. Any other answer is an ordinary response.

httpx's exceptions are converted here, at one edge: before the response has started they become
UpstreamUnavailable (502) or UpstreamTimeout (504); after it, the client connection is ended
(`Forwarded.aborted`), never made to look complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx
from starlette.types import Receive, Send

from gateway import tracing
from gateway.config import Upstream
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.hop_by_hop import HOP_BY_HOP
from gateway.http.request import Request
from gateway.http.transport import LeanTransport, tls_context
from gateway.settings import DEFAULTS
from gateway.usage import AnswerUsage

Headers = list[tuple[bytes, bytes]]
Switched = Callable[[Headers, Any], Awaitable[None]]  # (the 101's headers, its network stream)

BUFFERED_BODY_BYTES = 16 * 1024  # of a request body, read before an upstream connection is taken
MIN_BODY_RATE = 240.0      # bytes a second a request body averages once BODY_RATE_GRACE has passed ...
BODY_RATE_GRACE = 5.0      # ... seconds of waiting for it (Kestrel's MinRequestBodyDataRate defaults)
TRANSPORTS = ("lean", "httpx")


class ClientDisconnected(Exception):
    """The client went away while its body was being forwarded."""


class ClientTooSlow(ClientDisconnected):
    """The client sent nothing of its body for Settings.body_timeout seconds."""


log = logging.getLogger("gateway.proxy")

# the answer's status and fields as they arrive -> the (lowercase) names of fields withheld from the client
HeadHook = Callable[[int, httpx.Headers], frozenset[bytes]]


class Forwarded(NamedTuple):
    status: int
    aborted: bool  # the response broke off after it had started: the client connection is ended
    # seconds from the request's start to the answer's head: the upstream's time, whatever pace the
    # client then takes the body at (what a protected upstream's limit learns from)
    head: float = 0.0


def make_transport(upstream: Upstream, kind: str = "lean") -> httpx.AsyncBaseTransport:
    """HTTP/2 upstreams: httpx's AsyncHTTPTransport (h2, negotiated by ALPN; HTTP/2 only, so the
    framing is h2's). HTTP/1.1, plain or TLS: the lean transport, which reads exactly one response
    per request — httpx's HTTP/1.1 reuses a connection with bytes left over (tests/conformance).
    kind="httpx" puts HTTP/1.1 through httpx's transport too, for the comparison in the tests."""
    if upstream.http2 or kind == "httpx":
        limits = httpx.Limits(max_connections=upstream.max_connections,
                              max_keepalive_connections=upstream.max_connections, keepalive_expiry=15.0)
        context = tls_context(upstream) if upstream.url.startswith("https://") else None
        return httpx.AsyncHTTPTransport(verify=context or True, http1=not upstream.http2, http2=upstream.http2,
                                        limits=limits, retries=0)
    return LeanTransport(upstream)


class UpstreamClient:
    """One upstream: its transport, and what every request to it shares."""

    def __init__(self, upstream: Upstream, transport: str = "lean") -> None:
        self.upstream = upstream
        self.transport = make_transport(upstream, transport)
        self.kind = transport
        parts = urlsplit(upstream.url)
        self.url = httpx.URL(f"{parts.scheme}://{parts.netloc}/")
        self.host_header = parts.netloc.encode("idna")
        self.path_prefix = parts.path.rstrip("/").encode()
        self.timeouts = {"connect": upstream.connect_timeout, "read": upstream.timeout,
                         "write": upstream.timeout, "pool": upstream.connect_timeout}
        tracing.upstream(self)  # with traces on: forward() in a span, its trace context passed upstream

    async def close(self) -> None:
        await self.transport.aclose()

    async def forward(
        self,
        request: Request,
        body: RequestBody | None,
        send: Send,
        extra_response_headers: Headers,
        request_id: bytes,
        on_head: HeadHook | None = None,
        switched: Switched | None = None,
        usage: AnswerUsage | None = None,
    ) -> Forwarded:
        """Forward and stream the response to `send`. `on_head`, when given, sees the answer's status
        and fields as they arrive and returns the names of fields not to pass on to the client.

        Raises UpstreamUnavailable/UpstreamTimeout only before the response has started, and
        ClientDisconnected (ClientTooSlow) when the client's body stopped first.
        """
        if body is not None:
            # A client decides how fast its body comes: a small one is read whole, and the start of
            # a large one, before an upstream connection is taken (nginx buffers bodies likewise)
            await body.buffer(BUFFERED_BODY_BYTES)
        target = self.path_prefix + request.raw_path
        if request.query:
            target += b"?" + request.query
        outgoing = httpx.Request(
            request.method, self.url, headers=self._headers(request, body, request_id),
            stream=body if body is not None else _EMPTY, extensions={"target": target, "timeout": self.timeouts},
        )
        asked = time.perf_counter()
        try:
            response = await self.transport.handle_async_request(outgoing)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream '{self.upstream.name}' did not answer in time: {exc}") from None
        except httpx.TransportError as exc:
            raise UpstreamUnavailable(
                f"upstream '{self.upstream.name}' failed: {exc.__class__.__name__}: {exc}") from None
        status = response.status_code
        head = time.perf_counter() - asked
        if status == 101 and (not request.upgrade or switched is None):
            await response.aclose()
            raise UpstreamUnavailable(f"upstream '{self.upstream.name}' switched protocols unasked")
        stream = response.stream
        headers = _response_headers(response, extra_response_headers)
        if on_head is not None:
            withheld = on_head(status, response.headers)
            if withheld:
                headers = [field for field in headers if field[0] not in withheld]
        if status == 101:
            assert switched is not None
            upgraded = response.extensions.get("network_stream")
            try:
                if upgraded is None:
                    raise UpstreamUnavailable(f"upstream '{self.upstream.name}' switched protocols without a stream")
                await switched(headers, upgraded)
            finally:
                if upgraded is not None:
                    await upgraded.aclose()
                await response.aclose()
            return Forwarded(status, False, head)
        start = {"type": "http.response.start", "status": status, "headers": headers}
        if isinstance(stream, httpx.ByteStream):  # the whole body is in memory: one message, nothing to close
            await send(start)
            whole = b"".join(stream)
            await send({"type": "http.response.body", "body": whole, "more_body": False})
            if usage is not None:
                usage.feed(whole)
                usage.end(True)
            return Forwarded(status, False, head)
        try:
            assert isinstance(stream, httpx.AsyncByteStream)
            await send(start)
            feed = usage.feed if usage is not None else None  # the token budget's reader, after the head
            try:
                async for chunk in stream:
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        if feed is not None:  # read after the client has it: the stream never waits on it
                            feed(chunk)
            except httpx.TransportError as exc:
                if usage is not None:
                    usage.end(False)
                log.warning("upstream '%s' broke off its %d answer after it began (%s: %s): the client's "
                            "connection is ended; request id %s", self.upstream.name, status,
                            exc.__class__.__name__, exc, request_id.decode("latin-1"))
                return Forwarded(status, True, head)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if usage is not None:
                usage.end(True)
            return Forwarded(status, False, head)
        finally:
            await response.aclose()

    def _headers(self, request: Request, body: RequestBody | None, request_id: bytes) -> Headers:
        headers: Headers = [(b"host", self.host_header), *request.headers]
        peer = request.peer.encode()
        xff = request.forwarded_for
        headers.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
        headers.append((b"x-forwarded-proto", b"https" if request.scheme == "https" else b"http"))
        if request.host:
            headers.append((b"x-forwarded-host", request.host))
        headers.append((b"x-request-id", request_id))
        if request.upgrade:
            headers += ((b"connection", b"upgrade"), (b"upgrade", b"websocket"))
        if request.content_length is not None:
            headers.append((b"content-length", b"%d" % request.content_length))
        elif body is not None:
            headers.append((b"transfer-encoding", b"chunked"))
        return headers


def _response_headers(response: httpx.Response, extra: Headers) -> Headers:
    out: Headers = []
    named: set[bytes] = set()  # fields the upstream's Connection header makes hop-by-hop
    for name, value in response.headers.raw:
        name = name.lower()
        if name in HOP_BY_HOP:
            if name == b"connection":
                named.update(token.strip().lower() for token in value.split(b","))
            continue
        out.append((name, value))
    if response.status_code == 204:
        named.add(b"content-length")  # a 204 has no body, whatever the upstream says (RFC 9110 8.6)
    if named:
        out = [field for field in out if field[0] not in named]
    out.extend(extra)
    return out


class _Empty(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover


_EMPTY = _Empty()


class RequestBody(httpx.AsyncByteStream):
    """The request body: an already-read prefix, then the rest as it arrives from the client.

    The transport reads it while the upstream may already be answering; a failure on the client's
    side is kept in `failure` and raised as ClientDisconnected/ClientTooSlow, never as an httpx
    error, so the caller answers for the client (408/499), not the upstream.

    A client may pause its body for `timeout` (the body timeout) at most, and, once BODY_RATE_GRACE seconds
    have been spent waiting for it, must have sent MIN_BODY_RATE bytes for each second waited: a
    byte a second keeps no upstream connection. Only the time spent waiting for the client counts,
    not the time the upstream takes to read what was sent.
    """

    def __init__(self, prefix: bytes, more: bool, receive: Receive, timeout: float = DEFAULTS.body_timeout,
                 min_rate: float | None = None, grace: float | None = None) -> None:
        self.prefix = prefix
        self.more = more
        self.receive = receive
        self.timeout = timeout
        self.failure: ClientDisconnected | None = None
        self.min_rate = MIN_BODY_RATE if min_rate is None else min_rate
        self.grace = BODY_RATE_GRACE if grace is None else grace
        self.received = len(prefix)
        self.waited = 0.0  # seconds spent waiting for the client's bytes

    async def buffer(self, limit: int) -> None:
        """Read on until the body ends or `limit` bytes of it are held."""
        if not self.more or len(self.prefix) >= limit:
            return
        chunks = [self.prefix]
        size = len(self.prefix)
        while self.more and size < limit:
            chunk = await self._next()
            chunks.append(chunk)
            size += len(chunk)
        self.prefix = b"".join(chunks)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.prefix:
            yield self.prefix
        while self.more:
            chunk = await self._next()
            if chunk:
                yield chunk

    async def _next(self) -> bytes:
        allowed = min(self.timeout, self.grace + self.received / self.min_rate - self.waited)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if allowed <= 0:
                raise TimeoutError
            async with asyncio.timeout(allowed):  # (3.11's wait_for drops a cancel that meets a message)
                message = await self.receive()
        except TimeoutError:
            self.failure = ClientTooSlow()
            raise self.failure from None
        finally:
            self.waited += loop.time() - started
        if message["type"] == "http.disconnect":
            self.failure = ClientDisconnected()
            raise self.failure
        chunk: bytes = message.get("body", b"")
        self.more = message.get("more_body", False)
        self.received += len(chunk)
        return chunk
