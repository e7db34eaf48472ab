"""Streams one admitted request to its upstream and the answer back, in constant memory.

aiohttp's client is the forwarding path (httpx collapses under concurrency: encode/httpx#3215).
Its exceptions are converted to `UpstreamUnavailable` (502) and `UpstreamTimeout` (504) here and
nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.config import Upstream
from gateway.errors import UpstreamTimeout, UpstreamUnavailable

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
})
SKIP_AUTO = frozenset({"User-Agent", "Accept-Encoding", "Accept", "Content-Type"})


BODY_CHUNK_TIMEOUT = 30.0  # the worker sets it from Settings.body_timeout


class _ForwardRequest(aiohttp.ClientRequest):
    """Adds none of aiohttp's automatic headers (Accept, Accept-Encoding, User-Agent, Content-Type):
    the client's own headers pass as they were. (Overriding this beats `skip_auto_headers`, which
    rebuilds a sorted multidict on every request.)"""

    _skip = CIMultiDict((name, None) for name in SKIP_AUTO)

    def update_auto_headers(self, skip_auto_headers: Any) -> None:
        self._skip_auto_headers = self._skip


class ClientDisconnected(Exception):
    """The client went away while its body was being forwarded."""


class ClientTooSlow(ClientDisconnected):
    """The client sent nothing of its body for BODY_CHUNK_TIMEOUT seconds."""


def hop_by_hop(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Hop-by-hop names: the fixed set plus any named in the Connection header (names lowercase)."""
    extra = [
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    ]
    return HOP_BY_HOP | frozenset(extra) if extra else HOP_BY_HOP


class UpstreamPool:
    """One keep-alive connection pool per upstream."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.base = upstream.url
        self.session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=upstream.connect_timeout, sock_read=upstream.timeout
        )

    def open(self) -> aiohttp.ClientSession:
        if self.session is None:
            connector = aiohttp.TCPConnector(
                limit=self.upstream.max_connections,
                limit_per_host=0,
                ttl_dns_cache=10,
                enable_cleanup_closed=False,
            )
            self.session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                timeout=self.timeout,
                request_class=_ForwardRequest,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def forward(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: RequestBody | None,
        send: Send,
        extra_response_headers: list[tuple[bytes, bytes]],
    ) -> int:
        """Forward and stream the response to `send`. Returns the upstream status.

        Raises UpstreamUnavailable/UpstreamTimeout only before the response has started; after
        that a failure ends the client connection (an incomplete response is never made to look
        complete).
        """
        session = self.open()
        url = URL(self.base + target, encoded=True)
        try:
            response = await session.request(
                method, url, headers=headers, data=body.__aiter__() if body else None, allow_redirects=False,
                compress=None, chunked=None, raise_for_status=False, auto_decompress=False,
            )
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            if body is not None and body.failure is not None:
                raise body.failure from exc
            raise UpstreamTimeout(f"upstream '{self.upstream.name}' did not answer in time") from exc
        except ClientDisconnected:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            if body is not None and body.failure is not None:
                raise body.failure from exc
            raise UpstreamUnavailable(f"upstream '{self.upstream.name}' unreachable: {exc.__class__.__name__}") from exc
        try:
            lowered = [(k.lower(), v) for k, v in response.raw_headers]
            drop = hop_by_hop(lowered)
            out = [(k, v) for k, v in lowered if k not in drop]
            out.extend(extra_response_headers)
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            if method == "HEAD":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return response.status
            content = response.content
            try:
                while True:
                    chunk = await content.readany()
                    done = not chunk or content.is_eof()
                    await send({"type": "http.response.body", "body": chunk, "more_body": not done})
                    if done:
                        break
            except (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError):
                return -response.status  # the client connection is closed by the server
            return response.status
        finally:
            response.release()


class RequestBody:
    """The request body: an already-read prefix, then the rest as it arrives from the client.

    aiohttp sends it from its own task and reports a failure of ours as a connection error; the
    real cause is kept in `failure` so the caller can answer for the client, not the upstream.
    """

    def __init__(self, prefix: bytes, more: bool, receive: Receive) -> None:
        self.prefix = prefix
        self.more = more
        self.receive = receive
        self.failure: ClientDisconnected | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.prefix:
            yield self.prefix
        more = self.more
        while more:
            try:
                message = await asyncio.wait_for(self.receive(), BODY_CHUNK_TIMEOUT)
            except TimeoutError:
                self.failure = ClientTooSlow()
                raise self.failure from None
            if message["type"] == "http.disconnect":
                self.failure = ClientDisconnected()
                raise self.failure
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            if chunk:
                yield chunk
