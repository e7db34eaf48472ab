"""Where the decision script runs: one Redis server or a Redis Cluster.

Both speak through `RedisConnection`, so both pipeline every call of an event-loop tick into one
write. Cluster: every key of one decision shares a hash tag, so the call goes to the one node that
owns the slot; a `MOVED`/`ASK` reply refreshes the slot map and the call is retried once.
"""

from __future__ import annotations

import random
from typing import Any

from gateway.config import RedisSettings
from gateway.errors import RedisUnavailable
from gateway.redis_client import RedisAddress, RedisConnection, RedisReplyError
from gateway.scripts import Script


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


def make_runner(settings: RedisSettings) -> StandaloneRunner | ClusterRunner:
    if settings.mode == "cluster":
        return ClusterRunner(settings)
    return StandaloneRunner(settings)
