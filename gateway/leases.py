"""Concurrency leases: the slots an admitted request holds while it is in flight.

A route's `concurrency` rules take their slots in the route's one decision call (lua/decide.lua),
each slot a sorted-set member named by the request's lease token and scored by when it expires.
`Leases.hold` keeps them alive while the request lasts (renewed every third of the lease, so a
long download, an event stream or a WebSocket tunnel keeps its slot) and `Leases.release` gives
them back, exactly once, when the request ends however it ends: the response sent in full, the
client gone, the upstream failed, the tunnel closed. A gateway that dies holding slots loses them
when their lease runs out.

Give-backs and renewals of one event-loop tick leave together: one call of lua/leases.lua per
hash tag (a route's keys share one; Redis Cluster needs them in one slot). A give-back Redis cannot
take is tried again once a second later; past that the lease runs out by itself, so a slot is
never lost for longer than its lease.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import defaultdict

from gateway import metrics
from gateway.errors import RedisUnavailable
from gateway.limiter import Limiter

log = logging.getLogger("gateway.leases")

RETRY_AFTER = 1.0  # seconds before a failed give-back is tried again (once)
_PREFIX = os.urandom(6).hex().encode()
_COUNTER = itertools.count()


def new_token() -> bytes:
    """A lease token no other request of any gateway uses: random per process, then a counter."""
    return b"%s.%x" % (_PREFIX, next(_COUNTER))


class Lease:
    """One request's slots: its concurrency rules' keys and counts, under one token."""

    __slots__ = ("counts", "keys", "lease_us", "released", "renewal", "route", "rules", "token")

    def __init__(self, token: bytes, route: str, rules: list[str], keys: list[str], counts: list[int],
                 lease_us: list[int]) -> None:
        self.token = token
        self.route = route
        self.rules = rules
        self.keys = keys
        self.counts = counts
        self.lease_us = lease_us
        self.released = False
        self.renewal: asyncio.TimerHandle | None = None


def _tag(key: str) -> str:
    return key[key.index("{") + 1:key.index("}")]


class Leases:
    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.queued: dict[bool, list[Lease]] = {True: [], False: []}  # release? -> leases
        self.flushing = False
        self.pending: set[asyncio.Task[None]] = set()

    def hold(self, lease: Lease) -> None:
        """Renew `lease` every third of its shortest lease until it is released."""
        self._schedule(lease)

    def release(self, lease: Lease) -> None:
        """Give the slots back (once; later calls do nothing)."""
        if lease.released:
            return
        lease.released = True
        if lease.renewal is not None:
            lease.renewal.cancel()
            lease.renewal = None
        self._queue(True, lease)

    def _schedule(self, lease: Lease) -> None:
        loop = asyncio.get_running_loop()
        lease.renewal = loop.call_later(min(lease.lease_us) / 3_000_000, self._renew, lease)

    def _renew(self, lease: Lease) -> None:
        if lease.released:
            return
        self._queue(False, lease)
        self._schedule(lease)

    def _queue(self, release: bool, lease: Lease) -> None:
        self.queued[release].append(lease)
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Everything queued this tick: one call per kind and hash tag."""
        self.flushing = False
        for release in (True, False):
            leases, self.queued[release] = self.queued[release], []
            groups: dict[str, tuple[list[str], list[bytes | int], list[tuple[Lease, int]]]] = defaultdict(
                lambda: ([], [], []))
            for lease in leases:
                for i, key in enumerate(lease.keys):
                    keys, args, parts = groups[_tag(key)]
                    keys.append(key)
                    args += (lease.token, lease.counts[i], lease.lease_us[i])
                    parts.append((lease, i))
            for keys, args, parts in groups.values():
                self._send(release, keys, args, parts, retry=release)

    def _send(self, release: bool, keys: list[str], args: list[bytes | int], parts: list[tuple[Lease, int]],
              retry: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._call(release, keys, args, parts, retry))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _call(self, release: bool, keys: list[str], args: list[bytes | int], parts: list[tuple[Lease, int]],
                    retry: bool) -> None:
        try:
            await self.limiter.leases(release, keys, args)
        except RedisUnavailable as exc:
            kind = "release" if release else "renew"
            for lease, i in parts:
                metrics.lease_failures(lease.route, lease.rules[i], kind).inc()
            if retry:
                log.warning("Redis unavailable (%s): giving back %d concurrency slot(s) again in %.0fs",
                            exc.kind, len(parts), RETRY_AFTER)
                await asyncio.sleep(RETRY_AFTER)
                await self._call(release, keys, args, parts, retry=False)
            elif release:
                log.warning("Redis unavailable (%s): %d concurrency slot(s) are freed when their lease runs out",
                            exc.kind, len(parts))

    async def drain(self) -> None:
        """Send what is queued and wait for the calls under way (at shutdown)."""
        if self.flushing:
            self._flush()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
