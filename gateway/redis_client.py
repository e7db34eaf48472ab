"""A lean, pipelining Redis connection for the decision path.

Every command written during one event-loop tick leaves in one `write()`; replies are matched to
callers in order. There is no pool: one connection carries any number of requests in flight, which
is what makes a decision cheap. Errors from Redis come back as `RedisReplyError` values, never
raised inside the protocol. Connection trouble is raised to the caller as `RedisUnavailable`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

from gateway.errors import RedisUnavailable


class RedisReplyError(Exception):
    """An error reply from Redis (`-ERR ...`, `-NOSCRIPT ...`, `-MOVED ...`)."""


@dataclass(frozen=True)
class RedisAddress:
    host: str = "127.0.0.1"
    port: int = 6379
    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @classmethod
    def from_url(cls, url: str) -> RedisAddress:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        username = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password else None
        if parts.scheme == "unix":
            db = int(query.get("db", ["0"])[0])
            return cls(unix_path=parts.path, db=db, username=username, password=password)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}")
        db_text = parts.path.lstrip("/") or query.get("db", ["0"])[0]
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 6379,
            db=int(db_text or 0),
            username=username,
            password=password,
            tls=parts.scheme == "rediss",
        )

    def describe(self) -> str:
        return self.unix_path or f"{self.host}:{self.port}"


_ENCODED: dict[bytes | int, bytes] = {}  # bulk strings of recurring bytes and ints (rule args, costs)


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def encode(args: tuple[bytes | str | int, ...]) -> bytes:
    """One RESP command. Bytes and int arguments recur (script SHA, rule parameters, costs) and
    are encoded once; str arguments (keys) are encoded every time."""
    out = [b"*%d\r\n" % len(args)]
    append = out.append
    cache = _ENCODED
    for arg in args:
        if isinstance(arg, str):
            append(_bulk(arg.encode()))
            continue
        chunk = cache.get(arg)
        if chunk is None:
            chunk = _bulk(arg if isinstance(arg, bytes) else b"%d" % arg)
            if len(cache) < 4096:
                cache[arg] = chunk
        append(chunk)
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: RedisConnection) -> None:
        self.owner = owner
        self.reader = hiredis.Reader(replyError=RedisReplyError)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.owner.pending
        while True:
            reply = self.reader.gets()
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream is out of step
                self.owner.transport_lost(RedisUnavailable("unexpected reply from Redis"))
                return
            _, fut = pending.popleft()
            if not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.transport_lost(RedisUnavailable(f"connection to Redis lost: {exc or 'closed'}"))


class RedisConnection:
    """One connection, reconnected on demand. `call()` never blocks longer than `timeout`."""

    def __init__(self, address: RedisAddress, timeout: float, max_in_flight: int = 50_000) -> None:
        self.address = address
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.pending: deque[tuple[float, asyncio.Future[Any]]] = deque()  # (deadline, caller)
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._outbox: list[bytes] = []
        self._flush_scheduled = False

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        addr = self.address
        try:
            if addr.unix_path:
                transport, _ = await loop.create_unix_connection(
                    lambda: _Protocol(self), addr.unix_path
                )
            else:
                context = ssl.create_default_context() if addr.tls else None
                transport, _ = await loop.create_connection(
                    lambda: _Protocol(self), addr.host, addr.port, ssl=context
                )
        except OSError as exc:
            raise RedisUnavailable(f"cannot connect to Redis at {addr.describe()}: {exc}") from exc
        self._transport = transport  # uvloop's transport is not an asyncio.Transport subclass
        hello: list[tuple[bytes | str | int, ...]] = []
        if addr.password is not None:
            auth: tuple[str, ...] = (addr.username, addr.password) if addr.username else (
                addr.password,
            )
            hello.append(("AUTH", *auth))
        if addr.db:
            hello.append(("SELECT", addr.db))
        for args in hello:
            reply = await self._send(args, self.timeout)
            if isinstance(reply, RedisReplyError):
                self.close()
                raise RedisUnavailable(f"Redis refused {args[0]!r}: {reply}")

    async def _ensure(self, timeout: float) -> None:
        if self._transport is not None:
            return
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            await asyncio.wait_for(asyncio.shield(self._connecting), timeout)
        except TimeoutError as exc:
            raise RedisUnavailable("timed out connecting to Redis") from exc

    def transport_lost(self, error: RedisUnavailable) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        self._outbox.clear()
        while self.pending:
            _, fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(error)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is not None and self._outbox:
            self._transport.write(b"".join(self._outbox))
        self._outbox.clear()

    def _send(self, args: tuple[bytes | str | int, ...], timeout: float) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if len(self.pending) >= self.max_in_flight:
            fut.set_exception(RedisUnavailable("too many Redis calls in flight"))
            return fut
        deadline = loop.time() + timeout
        self.pending.append((deadline, fut))
        self._outbox.append(encode(args))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire_overdue)
        return fut

    def _expire_overdue(self) -> None:
        """One timer for all calls in flight: fail the overdue ones (their replies, if they ever
        come, are matched and dropped), then wait for the next deadline."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        next_deadline = None
        for deadline, fut in self.pending:
            if fut.done():
                continue
            if deadline <= now:
                fut.set_exception(RedisUnavailable("Redis did not answer in time"))
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
                break  # calls are queued in deadline order (all but a rare shorter retry)
        if next_deadline is not None:
            self._timer = loop.call_at(next_deadline, self._expire_overdue)

    def call(self, *args: bytes | str | int, timeout: float | None = None) -> Awaitable[Any]:
        """Send one command; await its reply (a `RedisReplyError` value for an error reply).
        Connected, this is one future: no coroutine frame on the hot path."""
        limit = self.timeout if timeout is None else timeout
        if self._transport is None:
            return self._connect_then_send(args, limit)
        return self._send(args, limit)

    async def _connect_then_send(self, args: tuple[bytes | str | int, ...], limit: float) -> Any:
        await self._ensure(limit)
        return await self._send(args, limit)

    def close(self) -> None:
        self.transport_lost(RedisUnavailable("connection closed"))

