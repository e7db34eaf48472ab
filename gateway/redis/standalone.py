"""One Redis server (redis://, rediss://, unix://), or the primary a Sentinel names: every batch goes
over ONE long-lived redis-py `Connection` of the runner, taken from the pool once, as its commands
packed together (`send_packed_command`) and their replies read in order (`read_response`). One batch
is on the wire at a time; calls queued meanwhile ride in the next one, so under load batches grow
and at low load a lone decision is one write and one read, without the client API's per-call pool
get/release, command lookup and reply callbacks (bench/redis_client.py measures both).

NOSCRIPT (after SCRIPT FLUSH, a restart, a failover to a server that never saw the script): the
calls that got it are sent again in a second round headed by one SCRIPT LOAD per script, inside
the same deadline, so no caller sees it.

A batch cut short (its deadline passed, the connection broke) leaves the connection disconnected
(redis-py's read_response does so on any exception while reading): the next batch reconnects, and
no reply is ever read by the wrong caller. After the breaker opened, `prepare` (its probe) makes a
new connection with the scripts loaded, off every request's path, and the next batch takes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.sentinel import Sentinel

from gateway.redis.batch import Arg, Batcher, QueuedCall, exchange, reply_waiting, warm
from gateway.redis.errors import REDIS_FAILURES, convert
from gateway.scripts import Script

log = logging.getLogger("gateway.redis")


class PipelineRunner(Batcher):
    max_batches = 1  # one connection: the next batch waits for this one's replies

    def __init__(self, client: Redis, timeout: float) -> None:
        super().__init__(timeout)
        self.client = client  # its pool: the decisions' connection, and ping/delete for the admin port
        self._connection: AbstractConnection | None = None
        self._spare: AbstractConnection | None = None  # made ready by `prepare`, for the next batch
        self._replies: list[Any] = []  # those of the round on the wire (one batch at a time)

    async def _pipeline(self, commands: Sequence[tuple[Arg, ...]]) -> list[Any]:
        """Send the commands on the runner's connection; a reply or an error reply per command."""
        if self._spare is not None:  # no batch is on the old one now (one batch at a time)
            old, self._connection, self._spare = self._connection, self._spare, None
            if old is not None:
                await self._put_back(old)
        connection = self._connection
        if connection is None:
            # taken once and never given back: the pool still closes it (aclose) and can mark it
            # for reconnecting (Sentinel, when the primary changes)
            connection = self._connection = await self.client.connection_pool.get_connection()
        elif connection.should_reconnect():
            await connection.disconnect()
        replies = self._replies = []
        return await exchange(connection, commands, replies)

    async def _send(self, batch: list[QueuedCall]) -> None:
        """At most two rounds: the second carries the calls that met NOSCRIPT (headed by SCRIPT
        LOAD) and those a demoted primary refused, if `_replica_refused` says so."""
        todo, load = batch, False
        for last in (False, True):
            loads: list[tuple[Arg, ...]] = []
            if load:
                scripts = {call.script.sha: call.script for call in todo}
                loads = [("SCRIPT", "LOAD", script.source) for script in scripts.values()]
            context = self._before()
            replies = await self._pipeline(loads + [call.command for call in todo])
            again: list[QueuedCall] = []
            refused: list[QueuedCall] = []
            for call, reply in zip(todo, replies[len(loads):], strict=True):
                if last or not isinstance(reply, rx.ResponseError):
                    call.settle(reply)
                elif isinstance(reply, rx.NoScriptError):
                    again.append(call)
                else:
                    refused.append(call)
                    call.reply = reply
            if refused:
                errors = [call.reply for call in refused if call.reply is not None]
                if await self._replica_refused(errors, context):
                    again.extend(refused)
                else:
                    for call in refused:
                        call.settle(call.reply)
            if not again:
                return
            todo, load = again, True

    def _replied(self, task: asyncio.Task[None]) -> bool:
        connection = self._connection  # the one batch in flight is on it
        return connection is not None and reply_waiting(connection)

    def _replies_read(self, task: asyncio.Task[None]) -> int:
        return len(self._replies)

    async def prepare(self, key: str, scripts: Sequence[Script], timeout: float) -> None:
        """The breaker's probe: a new connection, `scripts` loaded on it and Redis answering,
        within `timeout`; the next batch goes on that connection. Raises RedisUnavailable."""
        pool = self.client.connection_pool
        connection: AbstractConnection | None = None
        try:
            async with asyncio.timeout(timeout):
                connection = await pool.get_connection()
                await warm(connection, scripts)
        except BaseException as exc:
            if connection is not None:
                await self._put_back(connection)
            if isinstance(exc, REDIS_FAILURES):
                raise convert(exc) from exc
            raise
        if self._spare is not None:
            await self._put_back(self._spare)
        self._spare = connection
        self._unanswered = None

    async def _put_back(self, connection: AbstractConnection) -> None:
        """Close a connection of ours and give it back to the pool."""
        try:
            await connection.disconnect()
        except REDIS_FAILURES as exc:
            log.debug("closing a Redis connection: %s", exc)
        await self.client.connection_pool.release(connection)

    def _before(self) -> object:
        """Noted before a round is sent, for `_replica_refused` (Sentinel: the primary's address)."""
        return None

    async def _replica_refused(self, errors: list[BaseException], context: object) -> bool:
        """Were these error replies a demoted primary refusing writes (so nothing ran, and the calls
        may go again to the new one)? One server behind one address: READONLY (Redis 7 replies it by
        type) means the address now leads to a replica, or will lead to the new primary after a
        reconnect (a managed service moving its DNS name): drop the idle connections, go again."""
        if any(isinstance(e, rx.ReadOnlyError) for e in errors):
            await self.client.connection_pool.disconnect(inuse_connections=False)
            if self._connection is not None:
                await self._connection.disconnect()
            return True
        return False

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.client.ping()
        except REDIS_FAILURES as exc:
            raise convert(exc) from exc

    async def delete(self, key: str) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                return bool(await self.client.delete(key))
        except REDIS_FAILURES as exc:
            raise convert(exc) from exc

    async def close(self) -> None:
        await self.drain()
        if self._spare is not None:
            await self._put_back(self._spare)
            self._spare = None
        try:
            await self.client.aclose()
        except REDIS_FAILURES as exc:  # closing a connection that already broke
            log.debug("closing the Redis connections: %s", exc)


class SentinelRunner(PipelineRunner):
    """The primary that Sentinel names for `redis.sentinel_master` (redis-py's SentinelConnectionPool).

    redis-py asks the sentinels for the primary whenever it opens a connection, and drops a
    connection that gets READONLY (the primary it reached was demoted) or a connection error.
    Added here:

    - a demoted primary runs nothing a decision script writes (a replica refuses every write, and
      every decision script writes), so a batch it refused is sent once more, which reconnects to
      the new primary: a switch costs no decision an error. Redis 7 says so by type (READONLY,
      which redis-py's SentinelManagedConnection raises as a ConnectionError caused by a
      ReadOnlyError); Redis 6.2 wraps READONLY in a script error like any other, so there any error
      reply makes the runner ask the sentinels at once, and the calls go again only if they name
      another primary than the one the batch was sent to;
    - replication is asynchronous and a demoted primary keeps accepting writes until Sentinel
      reconfigures it (seconds later), and those writes are lost. So the sentinels are asked again
      every `check_interval` seconds while decisions flow; when they name another primary, idle
      connections are closed and busy ones are marked to reconnect once their batch is done.
    """

    check_interval = 1.0
    switch_window = 5.0  # seconds after a switch in which a closed connection is put down to it

    def __init__(self, sentinel: Sentinel, service: str, timeout: float) -> None:
        super().__init__(sentinel.master_for(service, redis_class=Redis), timeout)
        self.sentinel = sentinel
        self.service = service
        self._checked_at = time.monotonic()
        self._checking: asyncio.Task[None] | None = None
        self._primary: tuple[str, int] | None = None
        self._switched_at = -self.switch_window

    async def _pipeline(self, commands: Sequence[tuple[Arg, ...]]) -> list[Any]:
        self._maybe_check()
        sent_to = self.client.connection_pool.master_address  # type: ignore[attr-defined]
        self._noticed(sent_to)
        try:
            return await super()._pipeline(commands)
        except rx.ConnectionError as exc:
            # SentinelManagedConnection turns READONLY into ConnectionError, raised while handling
            # the ReadOnlyError: its context tells the two apart, by type
            if isinstance(exc.__context__, rx.ReadOnlyError):
                log.warning("the Redis primary was demoted (READONLY): asking the sentinels again")
                return await super()._pipeline(commands)
            # A demoted primary closes its clients' connections, and right after a switch redis-py
            # closes the idle ones to the old primary while a batch may be taking one (the pool's
            # disconnect and get_connection race). If the sentinels now name another primary, or
            # named a new one moments ago, the batch goes once more, to the primary they name:
            # writes the old one took after the switch are discarded when it resyncs, and one a
            # primary ran before its reply was lost can only be counted twice (a refusal too
            # early, never an admission too many). Otherwise the failure stands.
            primary = await self._check()
            switching = time.monotonic() - self._switched_at < self.switch_window
            if sent_to is None or primary is None or (primary == sent_to and not switching):
                raise
            log.warning("the connection to %s:%s closed in a failover: the batch goes to %s:%s",
                        *sent_to, *primary)
            return await super()._pipeline(commands)

    def _maybe_check(self) -> None:
        now = time.monotonic()
        if now - self._checked_at >= self.check_interval and (self._checking is None or self._checking.done()):
            self._checked_at = now
            self._checking = asyncio.get_running_loop().create_task(self._check_now())

    async def _check(self) -> tuple[str, int] | None:
        """Ask the sentinels for the primary now; on a new one, reconnect. None: no answer."""
        pool: Any = self.client.connection_pool  # a SentinelConnectionPool
        try:
            async with asyncio.timeout(self.timeout * 4):
                # asks the sentinels; on a new address it closes the idle connections
                primary: tuple[str, int] = await pool.get_master_address()
        except REDIS_FAILURES:
            return None  # the next check asks again; calls meanwhile go where they went
        if self._noticed(primary):
            log.warning("sentinel names a new primary %s:%s: reconnecting", *primary)
            await pool.update_active_connections_for_reconnect()
        return primary

    def _noticed(self, primary: tuple[str, int] | None) -> bool:
        """Is this another primary than the last one seen (by a check, or by redis-py when it
        connected)? If so, a switch happened now."""
        known, self._primary = self._primary, primary or self._primary
        if known is None or primary is None or primary == known:
            return False
        self._switched_at = time.monotonic()
        return True

    async def _check_now(self) -> None:
        await self._check()

    def _before(self) -> object:
        pool: Any = self.client.connection_pool
        return pool.master_address

    async def _replica_refused(self, errors: list[BaseException], context: object) -> bool:
        primary = await self._check()
        return context is not None and primary is not None and primary != context

    async def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
        await super().close()
        try:
            await self.sentinel.aclose()
        except REDIS_FAILURES as exc:
            log.debug("closing the sentinel connections: %s", exc)
