"""Where the decision script runs: one Redis server, a Redis Cluster, or a Sentinel-run primary.

Both speak through `RedisConnection`, so both pipeline every call of an event-loop tick into one
write. Cluster: every key of one decision shares a hash tag, so the call goes to the one node that
owns the slot; a `MOVED`/`ASK` reply refreshes the slot map and the call is retried once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from gateway.config import RedisSettings
from gateway.errors import RedisUnavailable
from gateway.redis_client import RedisAddress, RedisConnection, RedisReplyError
from gateway.scripts import Script

log = logging.getLogger("gateway.redis")


class StandaloneRunner:
    def __init__(self, settings: RedisSettings) -> None:
        self.conn = RedisConnection(RedisAddress.from_url(settings.url), settings.timeout)

    async def run(self, script: Script, keys: list[str], args: list[bytes | str | int]) -> Any:
        reply = await script.run(self.conn, keys, args)
        if isinstance(reply, RedisReplyError) and str(reply).startswith("READONLY"):
            self.conn.close()  # failed over: the next call reconnects to the new primary's address
        return reply

    async def command(self, key: str | None, *args: bytes | str | int) -> Any:
        return await self.conn.call(*args)

    def reset_connections(self) -> None:
        self.conn.close()

    def close(self) -> None:
        self.conn.close()


def key_slot(key: str) -> int:
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return _crc16(data) % 16384


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


class ClusterRunner:
    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.seed = RedisAddress.from_url(settings.url)
        self.nodes: dict[tuple[str, int], RedisConnection] = {}
        self.slots: list[tuple[str, int] | None] = [None] * 16384
        self._slot_cache: dict[str, int] = {}

    def _node(self, host: str, port: int) -> RedisConnection:
        conn = self.nodes.get((host, port))
        if conn is None:
            seed = self.seed
            address = RedisAddress(host, port, None, 0, seed.username, seed.password, seed.tls)
            conn = RedisConnection(address, self.settings.timeout)
            self.nodes[(host, port)] = conn
        return conn

    async def refresh(self) -> None:
        candidates = list(self.nodes.values()) or [self._node(self.seed.host, self.seed.port)]
        random.shuffle(candidates)
        last: Exception | None = None
        for conn in candidates:
            try:
                reply = await conn.call("CLUSTER", "SLOTS")
            except RedisUnavailable as exc:
                last = exc
                continue
            if isinstance(reply, RedisReplyError):
                last = reply
                continue
            for entry in reply:
                start, end, primary = entry[0], entry[1], entry[2]
                host = primary[0].decode() or conn.address.host
                owner = (host, int(primary[1]))
                self._node(*owner)
                for slot in range(start, end + 1):
                    self.slots[slot] = owner
            return
        raise RedisUnavailable(f"no cluster node answered CLUSTER SLOTS: {last}")

    async def run(self, script: Script, keys: list[str], args: list[bytes | str | int]) -> Any:
        tag = keys[0][: keys[0].find("}") + 1] if keys else ""
        slot = self._slot_cache.get(tag)
        if slot is None:
            slot = key_slot(keys[0]) if keys else 0
            self._slot_cache[tag] = slot
        for attempt in range(3):
            owner = self.slots[slot]
            if owner is None:
                await self.refresh()
                owner = self.slots[slot]
                if owner is None:
                    raise RedisUnavailable(f"no cluster node serves slot {slot}")
            conn = self.nodes[owner]
            reply = await script.run(conn, keys, args)
            if isinstance(reply, RedisReplyError):
                text = str(reply)
                if text.startswith(("MOVED", "ASK")):
                    _, _, where = text.split(" ", 2)
                    host, _, port = where.rpartition(":")
                    target = self._node(host or owner[0], int(port))
                    if text.startswith("ASK"):
                        await target.call("ASKING")
                        return await script.run(target, keys, args)
                    await self.refresh()
                    continue
                if text.startswith(("TRYAGAIN", "CLUSTERDOWN")) and attempt < 2:
                    await self.refresh()
                    continue
            return reply
        raise RedisUnavailable("cluster kept redirecting the call")

    async def command(self, key: str | None, *args: bytes | str | int) -> Any:
        if key is None:
            if not self.nodes:
                await self.refresh()
            return await next(iter(self.nodes.values())).call(*args)
        slot = key_slot(key)
        if self.slots[slot] is None:
            await self.refresh()
        owner = self.slots[slot]
        if owner is None:
            raise RedisUnavailable(f"no cluster node serves slot {slot}")
        return await self.nodes[owner].call(*args)

    def reset_connections(self) -> None:
        for conn in self.nodes.values():
            conn.close()
        self.slots = [None] * 16384

    def close(self) -> None:
        self.reset_connections()


class SentinelRunner:
    """The primary that Sentinel names for `redis.sentinel_master`, asked again after any
    connection failure or READONLY reply (a failover), so the next call reaches the new primary.

    URL: redis://[user:password@]sentinel-a:26379,sentinel-b:26379[/db] — the credentials and db
    are the primary's; the host list is the sentinels'.

    Replication is asynchronous: after a promotion, writes that still reach the old primary before
    it is demoted are lost. The sentinels are asked again every `check_interval` seconds, so the
    gateway leaves an old primary within about that long of the switch.
    """

    check_interval = 1.0

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        scheme, _, rest = settings.url.partition("://")
        userinfo, _, hosts_part = rest.rpartition("@")
        hosts, _, db = hosts_part.partition("/")
        self.template = RedisAddress.from_url(f"{scheme}://{userinfo + '@' if userinfo else ''}h/{db}")
        self.sentinels: list[RedisAddress] = []
        for item in hosts.split(","):
            host, _, port = item.strip().rpartition(":")
            self.sentinels.append(RedisAddress(host or item, int(port or 26379), tls=self.template.tls))
        self.conn: RedisConnection | None = None
        self._checked_at = 0.0
        self._checking: asyncio.Task[None] | None = None
        self._retired: set[RedisConnection] = set()

    async def _ask_sentinels(self) -> RedisAddress:
        last: object = None
        for address in self.sentinels:
            sentinel = RedisConnection(address, self.settings.timeout)
            try:
                reply = await sentinel.call("SENTINEL", "get-master-addr-by-name", self.settings.sentinel_master)
            except RedisUnavailable as exc:
                last = exc
                continue
            finally:
                sentinel.close()
            if isinstance(reply, list) and len(reply) == 2:
                t = self.template
                return RedisAddress(reply[0].decode(), int(reply[1]), None, t.db, t.username, t.password, t.tls)
            last = reply
        raise RedisUnavailable(f"no sentinel named a primary for {self.settings.sentinel_master!r}: {last}")

    async def _verify(self) -> None:
        try:
            address = await self._ask_sentinels()
        except RedisUnavailable:
            return
        old = self.conn
        if old is not None and old.address != address:
            log.warning("sentinel switched the primary to %s: reconnecting", address.describe())
            self.conn = RedisConnection(address, self.settings.timeout)
            # calls in flight on the old primary are answered (or time out) before it is closed
            self._retired.add(old)
            asyncio.get_running_loop().call_later(self.settings.timeout, self._close_retired, old)

    def _close_retired(self, conn: RedisConnection) -> None:
        self._retired.discard(conn)
        conn.close()

    def _maybe_verify(self) -> None:
        now = time.monotonic()
        if now - self._checked_at >= self.check_interval and (self._checking is None or self._checking.done()):
            self._checked_at = now
            self._checking = asyncio.ensure_future(self._verify())

    async def _primary(self) -> RedisConnection:
        if self.conn is not None:
            self._maybe_verify()
            return self.conn
        self._checked_at = time.monotonic()
        self.conn = RedisConnection(await self._ask_sentinels(), self.settings.timeout)
        return self.conn

    async def run(self, script: Script, keys: list[str], args: list[bytes | str | int]) -> Any:
        for attempt in range(2):
            conn = await self._primary()
            try:
                reply = await script.run(conn, keys, args)
            except RedisUnavailable:
                self._drop(conn)
                raise
            if isinstance(reply, RedisReplyError) and str(reply).startswith("READONLY") and attempt == 0:
                self._drop(conn)  # the old primary was demoted: ask the sentinels again
                continue
            return reply
        return reply

    async def command(self, key: str | None, *args: bytes | str | int) -> Any:
        conn = await self._primary()
        try:
            return await conn.call(*args)
        except RedisUnavailable:
            self._drop(conn)
            raise

    def _drop(self, conn: RedisConnection) -> None:
        """Forget `conn` if it is still the current one (a switch may have replaced it already)."""
        if self.conn is conn:
            self.reset_connections()

    def reset_connections(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        self.reset_connections()
        for conn in list(self._retired):
            self._close_retired(conn)


def make_runner(settings: RedisSettings) -> StandaloneRunner | ClusterRunner | SentinelRunner:
    if settings.mode == "cluster":
        return ClusterRunner(settings)
    if settings.mode == "sentinel":
        return SentinelRunner(settings)
    return StandaloneRunner(settings)
