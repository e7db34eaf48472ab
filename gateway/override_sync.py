"""A worker's copy of the overrides of its routes (gateway/overrides.py), kept in step with Redis:
the sync loop every entry point runs beside its Runtime."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.api_keys import KeyStore, KeyTable
from gateway.errors import RedisUnavailable
from gateway.overrides import FULL_SYNC_INTERVAL, SYNC_INTERVAL, Entry, RouteTable, Store, entry

if TYPE_CHECKING:
    from gateway.plan import RoutePlan
    from gateway.runtime import Runtime

log = logging.getLogger("gateway.overrides")


@dataclass
class Overrides:
    """One worker's copy of the overrides of its routes, kept in step with Redis (`sync`)."""

    stored: dict[tuple[str, str], tuple[int, dict[str, str]]] = field(default_factory=dict)  # version, texts
    built_for: Runtime | None = None
    cleaned_for: Runtime | None = None
    keys: KeyTable = field(default_factory=KeyTable)  # the API keys (gateway/api_keys.py), for every runtime
    signal: int | None = None  # the change signal as of the last poll of the versions
    polled_at: float = float("-inf")  # when that poll was (time.monotonic())

    async def sync(self, runtime: Runtime, full_every: float = FULL_SYNC_INTERVAL) -> bool:
        """Read what changed since the last sync and rebuild `runtime.overrides`; True if anything
        changed. At rest one read: the change signal (Store.signal), unchanged since the last poll
        of every route's versions; that poll also runs every `full_every` seconds whatever the
        signal says, so a write whose bump was lost (its writer died between the two) costs at most
        that long. Raises RedisUnavailable."""
        store = Store(runtime.limiter, runtime.redis.key_prefix)
        signal = await store.signal()  # before the poll: a change meanwhile is seen next time
        fresh = self.built_for is runtime and self.cleaned_for is runtime
        if fresh and signal == self.signal and time.monotonic() - self.polled_at < full_every:
            return False
        started = time.monotonic()
        keys_changed = False
        if runtime.config.keys is not None:
            keys_changed = await KeyStore(runtime.limiter, runtime.redis.key_prefix).follow(self.keys)
            runtime.keys = self.keys
        if self.cleaned_for is not runtime:
            dropped = await store.drop_removed(runtime.config)
            if dropped:
                log.info("dropped %d overrides of rules no longer in the file", dropped)
            self.cleaned_for = runtime
        plans = [plan for plan in runtime.plans.values() if plan.rules]
        all_versions = await asyncio.gather(*(store.versions(plan.route.name) for plan in plans))
        wanted: set[tuple[str, str]] = set()
        stale: list[tuple[str, str, int]] = []
        for plan, versions in zip(plans, all_versions, strict=True):
            for name in (r.name for r in plan.rules):
                at = (plan.route.name, name)
                wanted.add(at)
                version = versions.get(name, 0)
                have = self.stored.get(at)
                if (have[0] if have else 0) != version:
                    stale.append((*at, version))
        read = await asyncio.gather(*(self._read(store, route, name) for route, name, _ in stale))
        whole: set[str] = set()  # routes with a rule read whole: their tables are built again
        changed: list[tuple[str, str, dict[str, str | None]]] = []  # the others: these identities
        for (route, name), tokens in zip(((r, n) for r, n, _ in stale), read, strict=True):
            if tokens is None:
                whole.add(route)
            else:
                changed.append((route, name, tokens))
        for at in [at for at in self.stored if at not in wanted]:
            del self.stored[at]
        if self.built_for is not runtime:
            self.apply(runtime)
        else:
            for route in whole:
                self._rebuild(runtime, route)
            for route, name, tokens in changed:
                if route not in whole:
                    self._update(runtime, route, name, tokens)
        if stale or keys_changed:  # nothing held in memory may answer with the old numbers (or plans)
            runtime.refusals.clear()
            runtime.repeats.clear()  # the requests seen, with their rules as they were
        self.signal, self.polled_at = signal, started  # only once the poll went through
        return bool(stale) or keys_changed

    async def _read(self, store: Store, route: str, name: str) -> dict[str, str | None] | None:
        """Bring the stored texts of one rule up to date: the identities changed (None: read whole)."""
        have = self.stored.get((route, name))
        if have is not None and have[0] > 0:
            version, tokens = await store.changes(route, name, have[0])
            if tokens is not None:
                texts = have[1]
                for token, text in tokens.items():
                    if text is None:
                        texts.pop(token, None)
                    else:
                        texts[token] = text
                self.stored[(route, name)] = (version, texts)
                return tokens
        # the version first: a change meanwhile bumps it past the one kept, and is read next time
        version = (await store.versions(route)).get(name, 0)
        self.stored[(route, name)] = (version, await store.read_all(route, name))
        return None

    def _rebuild(self, runtime: Runtime, route: str) -> None:
        plan = runtime.plans.get(route)
        if plan is None:
            return
        table = self._table(plan)
        if table:
            runtime.overrides[route] = table
        else:
            runtime.overrides.pop(route, None)

    def _update(self, runtime: Runtime, route: str, name: str, tokens: dict[str, str | None]) -> None:
        """Apply the changed identities of one rule to `runtime.overrides` in place."""
        plan = runtime.plans.get(route)
        index = next((i for i, r in enumerate(plan.rules) if r.name == name), None) if plan else None
        if plan is None or index is None:
            return
        mine = runtime.overrides.setdefault(route, {}).setdefault(index, {})
        for token, text in tokens.items():
            found = None if text is None else self._entry(plan, index, text)
            if found is None:
                mine.pop(token, None)
            else:
                mine[token] = found
        if not mine:
            del runtime.overrides[route][index]
            if not runtime.overrides[route]:
                del runtime.overrides[route]

    @staticmethod
    def _entry(plan: RoutePlan, index: int, text: str) -> Entry | None:
        try:
            return entry(plan, index, text)
        except ValueError as exc:
            log.warning("override of %s/%s ignored: the rule no longer takes %s (%s)",
                        plan.route.name, plan.rules[index].name, text[:200], exc)
            return None

    def apply(self, runtime: Runtime) -> None:
        """Build `runtime.overrides` from the stored texts (at once: on a reload, before it serves)."""
        tables: dict[str, RouteTable] = {}
        for plan in runtime.plans.values():
            table = self._table(plan)
            if table:
                tables[plan.route.name] = table
        runtime.overrides = tables
        runtime.keys = self.keys if runtime.config.keys is not None else None
        self.built_for = runtime

    def _table(self, plan: RoutePlan) -> RouteTable:
        table: RouteTable = {}
        for index, rule in enumerate(plan.rules):
            have = self.stored.get((plan.route.name, rule.name))
            if not have or not have[1]:
                continue
            shared: dict[str, Entry | None] = {}  # overrides with the same numbers share one Entry
            mine: dict[str, Entry] = {}
            for token, text in have[1].items():
                if text not in shared:
                    shared[text] = self._entry(plan, index, text)
                found = shared[text]
                if found is not None:
                    mine[token] = found
            if mine:
                table[index] = mine
        return table


async def keep_in_step(overrides: Overrides, current: Callable[[], Runtime | None],
                       interval: float = SYNC_INTERVAL) -> None:
    """Sync `overrides` with Redis every `interval` seconds, for the Runtime `current()` returns."""
    failing = False
    while True:
        await asyncio.sleep(interval)
        runtime = current()
        if runtime is None:
            continue
        try:
            await overrides.sync(runtime)
        except RedisUnavailable as exc:
            if not failing:
                log.warning("overrides not synced, Redis unavailable (%s); the last ones read stay in force", exc)
            failing = True
        except Exception:  # the loop must outlive any one bad poll
            log.exception("overrides not synced; the last ones read stay in force")
        else:
            failing = False
