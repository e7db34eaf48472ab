"""One Redis server (redis://, rediss://, unix://), or the primary a Sentinel names: a batch is one
redis-py pipeline (transaction=False) on one pooled connection.

NOSCRIPT (after SCRIPT FLUSH, a restart, a failover to a server that never saw the script): the
calls that got it are sent again in a second pipeline headed by one SCRIPT LOAD per script, inside
the same deadline, so no caller sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from gateway.redis.batch import Arg, Batcher, Call
from gateway.redis.errors import REDIS_FAILURES, convert

log = logging.getLogger("gateway.redis")


class PipelineRunner(Batcher):
    def __init__(self, client: Redis, timeout: float) -> None:
        super().__init__(timeout)
        self.client = client

    async def _pipeline(self, commands: Sequence[tuple[Arg, ...]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.pipeline_execute_command(*command)
        # raise_on_error=False: an error reply is that command's result, the others stand
        return await pipe.execute(raise_on_error=False)

    async def _send(self, batch: list[Call]) -> None:
        replies = await self._pipeline([call.command for call in batch])
        missing: list[Call] = []
        read_only = False
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, rx.NoScriptError):
                missing.append(call)
                continue
            read_only = read_only or isinstance(reply, rx.ReadOnlyError)
            call.settle(reply)
        if read_only:  # a primary demoted behind the same address: reconnect for the next calls
            await self.client.connection_pool.disconnect(inuse_connections=False)
        if missing:
            scripts = {call.script.sha: call.script for call in missing}
            loads: list[tuple[Arg, ...]] = [("SCRIPT", "LOAD", script.source) for script in scripts.values()]
            replies = await self._pipeline(loads + [call.command for call in missing])
            for call, reply in zip(missing, replies[len(loads):], strict=True):
                call.settle(reply)

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
        try:
            await self.client.aclose()
        except REDIS_FAILURES as exc:  # closing a connection that already broke
            log.debug("closing the Redis connections: %s", exc)


class SentinelRunner(PipelineRunner):
    """The primary that Sentinel names for `redis.sentinel_master` (redis-py's SentinelConnectionPool).

    redis-py asks the sentinels for the primary whenever it opens a connection, and drops a
    connection that gets a connection error or READONLY (the primary it reached was demoted). Two
    things are added here:

    - a batch that failed because the primary answered READONLY was not run by Redis (a replica
      refuses every write, and every decision script writes), so it is sent once more, which
      reconnects to the new primary: a switch costs no decision an error;
    - replication is asynchronous and a demoted primary keeps accepting writes until Sentinel
      reconfigures it (seconds later), and those writes are lost. So the sentinels are asked again
      every `check_interval` seconds while decisions flow; when they name another primary, idle
      connections are closed and busy ones are marked to reconnect once their batch is done.
    """

    check_interval = 1.0

    def __init__(self, sentinel: Sentinel, service: str, timeout: float) -> None:
        super().__init__(sentinel.master_for(service, redis_class=Redis), timeout)
        self.sentinel = sentinel
        self.service = service
        self._checked_at = time.monotonic()
        self._checking: asyncio.Task[None] | None = None

    async def _pipeline(self, commands: Sequence[tuple[Arg, ...]]) -> list[Any]:
        self._maybe_check()
        try:
            return await super()._pipeline(commands)
        except rx.ConnectionError as exc:
            # SentinelManagedConnection turns READONLY into ConnectionError, raised while handling
            # the ReadOnlyError: its context tells the two apart, by type
            if not isinstance(exc.__context__, rx.ReadOnlyError):
                raise
            log.warning("the Redis primary was demoted (READONLY): asking the sentinels again")
            return await super()._pipeline(commands)

    def _maybe_check(self) -> None:
        now = time.monotonic()
        if now - self._checked_at >= self.check_interval and (self._checking is None or self._checking.done()):
            self._checked_at = now
            self._checking = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        pool: Any = self.client.connection_pool  # a SentinelConnectionPool
        before = pool.master_address
        try:
            async with asyncio.timeout(self.timeout * 4):
                # asks the sentinels; on a new address it closes the idle connections
                primary = await pool.get_master_address()
        except REDIS_FAILURES:
            return  # the next check asks again; calls meanwhile go where they went
        if before is not None and primary != before:
            log.warning("sentinel names a new primary %s:%s: reconnecting", *primary)
            await pool.update_active_connections_for_reconnect()

    async def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
        await super().close()
        try:
            await self.sentinel.aclose()
        except REDIS_FAILURES as exc:
            log.debug("closing the sentinel connections: %s", exc)
