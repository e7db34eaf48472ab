"""Redis Cluster: the calls of a batch, grouped by the node owning their slot, one pipeline per node,
the nodes in parallel. Every key of one decision shares the route's hash tag, so a call is one slot.

redis-py's RedisCluster keeps the slot map and the node connections (NodesManager, ClusterNode);
this module only groups and answers the replies that are not results, per call:

    MOVED        the slot has a new owner: NodesManager.move_slot() records it; sent again there
    ASK          the slot is migrating and a key is already on the target: sent again to the
                 target as ASKING + EVALSHA, adjacent in ONE node pipeline, so both are on the same
                 connection (redis-py's own ASK path sends ASKING as a separate pooled command and
                 the next command may take another connection: see ClusterNode.acquire_connection,
                 a FIFO, and RedisCluster._execute_command)
    TRYAGAIN     the keys of a multi-key call are split between the two nodes mid-migration: sent
                 again after a short pause, until they are together
    CLUSTERDOWN  (or a slot no node covers) the slot map is read again, then sent again
    NOSCRIPT     sent again after SCRIPT LOAD on that node, in the same node pipeline

Each of these replies means Redis did not run the script, so sending it again cannot count it twice.
A connection that fails while replies are read may have run it: those calls fail (RedisUnavailable)
and the slot map is read again in the background, for the calls after them.
Every retry happens inside the batch's deadline (redis.timeout).

redis-py's ClusterPipeline (8.1) is not used: it sends the MOVED/ASK/TRYAGAIN calls of a batch again
one by one through RedisCluster.execute_command, whose ASK path is the separate ASKING above, and
which every 5th MOVED closes every node connection (in-flight calls of other batches included) to
read the map again; CLUSTERDOWN and NOSCRIPT it leaves to the caller. Under the live-resharding
test (tests/test_cluster_resharding.py) it failed 196 decisions (ClusterError "TTL exhausted",
ConnectionError); this module fails none. Its parts that work are used: the slot map
(NodesManager) and the node connections (ClusterNode), each node's calls of a batch written on one of
its connections as one packed write (gateway.redis.batch.exchange), as ClusterNode.execute_pipeline
does but without its per-command PipelineCommand, packing and reply callbacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import ClusterNode, RedisCluster

from gateway.redis.batch import Arg, Batcher, QueuedCall, exchange, reply_waiting, warm
from gateway.redis.errors import REDIS_FAILURES, convert
from gateway.scripts import Script

log = logging.getLogger("gateway.redis")

TRYAGAIN_PAUSE = 0.002  # seconds between rounds while a slot's keys are migrating
REFRESH_PAUSE = 0.01    # after CLUSTERDOWN, before asking again

# the batch whose node pipelines run in this context (asyncio.gather's tasks inherit it)
_BATCH: ContextVar[asyncio.Task[None] | None] = ContextVar("batch", default=None)


class _Pending:
    """A call on its way: where it goes next and what must precede it there."""

    __slots__ = ("ask", "call", "reload", "slot")

    def __init__(self, call: QueuedCall, slot: int) -> None:
        self.call = call
        self.slot = slot
        self.ask: ClusterNode | None = None  # send ASKING first, to this node
        self.reload = False                  # SCRIPT LOAD first


class ClusterRunner(Batcher):
    def __init__(self, cluster: RedisCluster, timeout: float) -> None:
        super().__init__(timeout)
        self.cluster = cluster
        self.redirects: Counter[str] = Counter()  # replies answered by sending again, by kind
        self._refresh: asyncio.Task[None] | None = None
        # batch -> the connections it reads, each with the list its replies are read into
        self._reading: dict[asyncio.Task[None], list[tuple[Any, list[Any]]]] = {}
        self._map_lock = asyncio.Lock()
        self._map_reads = 0

    def failure_domain(self, key: str) -> int | None:
        return int(self.cluster.keyslot(key))

    def _replied(self, task: asyncio.Task[None]) -> bool:
        reading = self._reading.get(task, [])
        return bool(reading) and all(reply_waiting(connection) for connection, _ in reading)

    def _replies_read(self, task: asyncio.Task[None]) -> int:
        return sum(len(replies) for _, replies in self._reading.get(task, []))

    async def _send(self, batch: list[QueuedCall]) -> None:
        _BATCH.set(asyncio.current_task())
        cluster = self.cluster
        await cluster.initialize()  # reads the slot map the first time; after that, returns
        keyslot = cluster.keyslot
        todo = [_Pending(call, keyslot(call.keys[0]) if call.keys else 0) for call in batch]
        while todo:
            todo, pause = await self._round(todo)
            if pause:
                await asyncio.sleep(pause)

    async def _round(self, todo: list[_Pending]) -> tuple[list[_Pending], float]:
        """Send every pending call once; return those to send again and how long to wait first."""
        manager = self.cluster.nodes_manager
        groups: dict[str, tuple[ClusterNode, list[_Pending]]] = {}
        again: list[_Pending] = []
        pause = 0.0
        refresh = False
        for item in todo:
            if item.ask is not None:
                node = item.ask
            else:
                try:
                    node = manager.get_node_from_slot(item.slot)
                except rx.SlotNotCoveredError:  # read the map again, then send again
                    again.append(item)
                    pause = REFRESH_PAUSE
                    refresh = True
                    continue
            group = groups.get(node.name)
            if group is None:
                groups[node.name] = (node, [item])
            else:
                group[1].append(item)
        # each node's calls are settled as soon as that node answers: a node that hangs holds back
        # only its own calls (until the batch's deadline), never those another node answered
        for more, wait, reread in await asyncio.gather(*(self._node_round(node, items)
                                                         for node, items in groups.values())):
            again += more
            pause = max(pause, wait)
            refresh = refresh or reread
        if refresh:
            await manager.initialize()
        return again, pause

    async def _node_round(self, node: ClusterNode, items: list[_Pending]) -> tuple[list[_Pending], float, bool]:
        """Send `node` its calls once and settle what it answered; return those to send again, how
        long to wait first, and whether to read the slot map again."""
        manager = self.cluster.nodes_manager
        replies = await self._node_pipeline(node, items)
        again: list[_Pending] = []
        pause = 0.0
        refresh = False
        for item, reply in zip(items, replies, strict=True):
            if not isinstance(reply, rx.ResponseError):
                if isinstance(reply, BaseException):  # the node's failure (`_node_pipeline`)
                    self._refresh_soon()  # the node may have gone: the calls after these find out
                item.call.settle(reply)
                continue
            if isinstance(reply, rx.MovedError):  # (a subclass of AskError: first)
                await manager.move_slot(reply)
                item.ask = None
                kind = "moved"
            elif isinstance(reply, rx.AskError):
                item.ask = self._node(reply.host, reply.port)
                kind = "ask"
            elif isinstance(reply, rx.TryAgainError):
                pause = max(pause, TRYAGAIN_PAUSE)
                kind = "tryagain"
            elif isinstance(reply, rx.ClusterDownError):
                refresh = True
                item.ask = None
                pause = REFRESH_PAUSE
                kind = "clusterdown"
            elif isinstance(reply, rx.NoScriptError) and not item.reload:
                item.reload = True
                kind = "noscript"
            else:
                item.call.settle(reply)
                continue
            self.redirects[kind] += 1
            again.append(item)
        return again, pause, refresh

    async def _node_pipeline(self, node: ClusterNode, items: list[_Pending]) -> list[Any]:
        """The items' commands in one packed write on one connection of `node` (at low load always
        the same one: the node keeps it), a reply or an exception per item."""
        commands: list[tuple[Arg, ...]] = []
        loads = {item.call.script.sha: item.call.script for item in items if item.reload}
        for script in loads.values():
            commands.append(("SCRIPT", "LOAD", script.source))
        at: list[int] = []  # where each item's reply is among the commands'
        for item in items:
            if item.ask is not None:
                commands.append((b"ASKING",))
            at.append(len(commands))
            commands.append(item.call.command)
        replies: list[Any] = []
        try:
            connection = node.acquire_connection()
        except REDIS_FAILURES as exc:  # MaxConnectionsError
            return [convert(exc)] * len(items)
        batch = _BATCH.get()
        reading = self._reading.setdefault(batch, []) if batch is not None else []
        mine = (connection, replies)
        reading.append(mine)
        try:
            await node.disconnect_if_needed(connection)
            await exchange(connection, commands, replies)
        except REDIS_FAILURES as exc:
            # the connection failed while sending (nothing ran) or while reading (the calls whose
            # replies did not come may have run): either way those calls fail, with one exception
            # (gateway/breaker.py counts a failed round trip once)
            self._refresh_soon()
            replies.extend([convert(exc)] * (len(commands) - len(replies)))
        finally:
            node.release(connection)
            reading.remove(mine)
            if not reading and batch is not None:
                self._reading.pop(batch, None)
        return [replies[i] for i in at]

    async def prepare(self, key: str, scripts: Sequence[Script], timeout: float) -> None:
        """The breaker's probe for `key`'s slot: the slot map read again (a replica may have taken
        over), `scripts` loaded on a connection of the slot's node and the node answering, within
        `timeout`; the connection goes back to the node for the next batch. Raises RedisUnavailable."""
        manager = self.cluster.nodes_manager
        try:
            async with asyncio.timeout(timeout):
                reads = self._map_reads
                async with self._map_lock:  # the probes of many slots read the map once
                    if reads == self._map_reads:
                        await manager.initialize()
                        self._map_reads += 1
                node = manager.get_node_from_slot(self.cluster.keyslot(key))
                connection = node.acquire_connection()
                try:
                    await node.disconnect_if_needed(connection)
                    await warm(connection, scripts)
                finally:
                    node.release(connection)
        except REDIS_FAILURES as exc:
            raise convert(exc) from exc
        self._unanswered = None

    def _node(self, host: str, port: int) -> ClusterNode:
        """The ASK target: a node of the map, or one not in it yet (it owns no slot so far)."""
        manager = self.cluster.nodes_manager
        node = manager.get_node(host=host, port=port)
        if node is None:
            node = ClusterNode(host, port, "primary", **manager.connection_kwargs)
            manager.set_nodes(manager.nodes_cache, {node.name: node})
        return node

    def _refresh_soon(self) -> None:
        """Read the slot map again in the background (once at a time), e.g. after a failover."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_map())

    async def _refresh_map(self) -> None:
        try:
            async with asyncio.timeout(max(self.timeout, 1.0)):
                await self.cluster.nodes_manager.initialize()
        except REDIS_FAILURES as exc:
            log.warning("could not read the Redis Cluster slot map: %s", exc)

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.cluster.initialize()
                await self.cluster.execute_command("PING", target_nodes=RedisCluster.PRIMARIES)
        except REDIS_FAILURES as exc:
            raise convert(exc) from exc

    async def delete(self, key: str) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                return bool(await self.cluster.delete(key))  # routed by the key's slot, MOVED/ASK followed
        except REDIS_FAILURES as exc:
            raise convert(exc) from exc

    async def close(self) -> None:
        await self.drain()
        if self._refresh is not None:
            self._refresh.cancel()
        try:
            await self.cluster.aclose()
        except REDIS_FAILURES as exc:  # closing a connection that already broke
            log.debug("closing the Redis Cluster connections: %s", exc)
