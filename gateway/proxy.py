"""Streams one admitted request to its upstream and the answer back, in constant memory.

The HTTP/1.1 client underneath is `upstream_http` (httptools' parser on asyncio protocols). Its
failures become `UpstreamUnavailable` (502) and `UpstreamTimeout` (504) before the response has
started; after that the client connection is ended, never made to look complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.config import Upstream
from gateway.errors import UpstreamUnavailable
from gateway.upstream_http import IDEMPOTENT, Connection, ConnectionPool, ResponseAborted, request_head

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
})

BODY_CHUNK_TIMEOUT = 30.0  # the worker sets it from Settings.body_timeout


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
    """One keep-alive connection pool per upstream (opened on first use, inside the event loop)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.pool: ConnectionPool | None = None

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    async def forward(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: RequestBody | None,
        send: Send,
        extra_response_headers: list[tuple[bytes, bytes]],
    ) -> int:
        """Forward and stream the response to `send`. Returns the upstream status, negated when
        the response broke off after it had started.

        Raises UpstreamUnavailable/UpstreamTimeout only before the response has started, and
        ClientDisconnected (ClientTooSlow) when the client's body stopped first.
        """
        pool = self.pool
        if pool is None:
            pool = self.pool = ConnectionPool(self.upstream)
        chunked = body is not None and not any(name == b"content-length" for name, _ in headers)
        head = request_head(pool, method, target, headers, chunked)
        head_only = method == b"HEAD"
        while True:
            conn = pool.take_idle() or await pool.connect()
            conn.begin(head, head_only, self.upstream.timeout)
            sender = None
            if body is not None:
                sender = asyncio.ensure_future(_send_body(conn, body, chunked))
            try:
                await conn.head  # type: ignore[misc]
            except BaseException as exc:
                if sender is not None and not sender.done():
                    sender.cancel()
                conn.close()
                pool.release(conn)
                if body is not None and body.failure is not None:
                    raise body.failure from None
                if (isinstance(exc, UpstreamUnavailable) and conn.served > 0 and not conn.got_bytes
                        and body is None and method in IDEMPOTENT):
                    continue  # the upstream closed a kept-alive connection as we reused it: once more
                raise
            break
        try:
            headers = conn.headers  # names lowercase
            drop = hop_by_hop(headers) if any(name == b"connection" for name, _ in headers) else HOP_BY_HOP
            out = [(k, v) for k, v in headers if k not in drop]
            out.extend(extra_response_headers)
            status = conn.status
            await send({"type": "http.response.start", "status": status, "headers": out})
            try:
                while True:
                    chunk = await conn.read()
                    if not chunk:
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        break
                    if conn.complete and not conn.chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except ResponseAborted:
                return -status  # the server closes the client connection: the body is incomplete
            return status
        finally:
            if sender is not None and not sender.done():
                sender.cancel()  # answered before the whole body was sent: the connection goes
                conn.close()
            pool.release(conn)


async def _send_body(conn: Connection, body: RequestBody, chunked: bool) -> None:
    try:
        async for chunk in body:
            conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            if conn.write_paused:
                await conn.drain()
        if chunked:
            conn.write(b"0\r\n\r\n")
    except ClientDisconnected as exc:
        conn.fail(exc)
    except OSError as exc:
        conn.fail(UpstreamUnavailable(f"upstream '{conn.pool.name}' stopped taking the request body: {exc}"))


class RequestBody:
    """The request body: an already-read prefix, then the rest as it arrives from the client.

    It is sent from a task of its own (the upstream may answer before it has all of it); a failure
    on the client's side is kept in `failure` so the caller answers for the client (408/499), not
    the upstream.
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
