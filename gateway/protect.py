"""Protecting an upstream: an adaptive limit on the requests in flight to it, per worker.

A `Guard` stands in front of one upstream (or one route, with a `protect:` of its own). Each request
the proxy port forwards takes a `Slot` from it before its rules are asked (gateway/pipeline.py), and
gives it back when its exchange with the upstream has ended (gateway/endpoint.py), with the time the
upstream took. At the limit the request is refused (503, Retry-After) unless its priority may still
fill more of the limit: the last priority may fill its share (50% by default), the first all of it.

The limit follows AIMD with a gradient's increase (docs/algorithms.md: measured against a gradient,
Vegas and plain AIMD): answer times are gathered in windows of a few unloaded answer times, and at
the end of each the window's percentile is compared with the reference, the target or twice the
unloaded answer time, whichever is lower, but never below 1.25 times the unloaded time. Slower, or
an answer that timed out or was the upstream's 503 or 504: a tenth off the limit. Not slower, and
the limit in use (half of it in flight, or a request refused): it grows by its square root.

The unloaded answer time is the lowest window low (10th percentile) seen. Every PROBE_EVERY seconds
one window runs at half the limit, the upstream's queue drains, and its low replaces the old one;
so too as soon as SHRINKING_WINDOWS windows in a row were too slow while the limit fell: no queue
explains that, the upstream is slower for good, and it is measured anew.

`scope: fleet`: the limit and the requests in flight are one for every gateway sharing the Redis
(`Fleet`, lua/protect.lua). A slot is a lease in a sorted set, taken in one call (refused there at
the priority's share of the fleet's limit) and given back and renewed as a concurrency rule's are
(gateway/leases.py), so a gateway that dies gives its slots back when their lease runs out. Each
worker's controller still measures the answers it sees, from the fleet's limit and in-flight count;
when its window closes it proposes its next limit, which the fleet takes unless another gateway
stepped it less than a window ago: the fleet steps as one controller would. Redis unavailable: the
route's failure_mode; open falls back to the worker's own count against the last limit it saw.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial

from gateway import metrics
from gateway.config import Priority, Protect, Route
from gateway.errors import RedisUnavailable
from gateway.identity import RequestView
from gateway.kept import kept
from gateway.keys import protect_keys
from gateway.leases import Lease, Leases, new_token
from gateway.limiter import Limiter

log = logging.getLogger("gateway.protect")

INITIAL_LIMIT = 10
WINDOW_MIN = 0.1          # seconds a window lasts at least ...
WINDOW_ANSWER_TIMES = 4   # ... and at least this many unloaded answer times
WINDOW_SAMPLES = 10       # answers a window needs before it is read (timeouts, 503s and 504s count)
TOLERANCE = 2.0           # without a target: answers may take up to twice the unloaded time
BUFFER = 1.25             # ... and the reference is never below 1.25 times it (the noise of any upstream)
LOW_PERCENTILE = 10       # a window's low: its unloaded answer time, robust to one odd fast answer
PROBE_EVERY = 30.0        # seconds between windows run at half the limit, jittered by a fifth
SHRINKING_WINDOWS = 4     # ... and one as soon as this many windows in a row were too slow, the limit falling
RETRY_AFTER = 1           # seconds a refused request is told to wait

# (limit, the window's percentile, the unloaded answer time, the reference, a timeout seen, the limit in use)
Rule = Callable[[float, float, float, float, bool, bool], float]


def aimd_sqrt(limit: float, seen: float, unloaded: float, reference: float, dropped: bool, in_use: bool) -> float:
    """The next limit: a tenth off while the answers are slower than the reference or one timed out,
    plus its square root while they are not and it is in use."""
    if dropped or seen > reference:
        return limit * 0.9
    return limit + math.sqrt(limit) if in_use else limit


class Controller:
    """The limit and what it is computed from; every method takes the time, so it runs on any clock."""

    def __init__(self, protect: Protect, now: float, rule: Rule = aimd_sqrt) -> None:
        self.protect = protect
        self.rule = rule
        self.limit = float(min(protect.max_limit, max(protect.min_limit, INITIAL_LIMIT)))
        self.unloaded: float | None = None  # seconds: the upstream's answer time with no queue
        self.seen: float | None = None      # the last window's percentile
        self.samples: list[float] = []
        self.drops = 0                      # answers in the window that said overload (a timeout, a 503, a 504)
        self.busiest = 0                    # the most in flight during the window
        self.refused = 0                    # requests refused during the window
        self.started = now
        self.probing = False
        self.next_probe = now + _jittered(PROBE_EVERY)
        self.shrinking = 0                  # windows in a row that were too slow though the limit fell

    @property
    def in_force(self) -> float:
        """The limit admissions are held to: half of it while a probe drains the upstream's queue."""
        return max(self.protect.min_limit, self.limit / 2) if self.probing else self.limit

    def sample(self, seconds: float, now: float) -> bool:
        """One answer's time; True when it closed a window (the limit may have changed)."""
        self.samples.append(seconds)
        return self._maybe_update(now)

    def drop(self, now: float) -> bool:
        """An exchange the upstream did not answer in time, or answered 503 or 504."""
        self.drops += 1
        return self._maybe_update(now)

    def window(self) -> float:
        return max(WINDOW_MIN, WINDOW_ANSWER_TIMES * (self.unloaded or 0.0))

    def _maybe_update(self, now: float) -> bool:
        if now - self.started < self.window() or len(self.samples) + self.drops < WINDOW_SAMPLES:
            return False
        if self.samples:
            self._update(now)
        else:  # nothing but overload answers
            self.limit = max(float(self.protect.min_limit), self.limit * 0.9)
        self.samples.clear()
        self.drops = 0
        self.busiest = self.refused = 0
        self.started = now
        return True

    def _update(self, now: float) -> None:
        ordered = sorted(self.samples)
        low = _percentile(ordered, LOW_PERCENTILE)
        self.seen = _percentile(ordered, self.protect.percentile)
        if self.probing:  # the queue has drained: this window's low is the unloaded time now
            self.unloaded, self.probing = low, False
            self.next_probe = now + _jittered(PROBE_EVERY)
            return
        unloaded = self.unloaded = low if self.unloaded is None else min(low, self.unloaded)
        in_use = self.refused > 0 or 2 * self.busiest >= self.limit
        new = self.rule(self.limit, self.seen, unloaded, self.reference(), self.drops > 0, in_use)
        new = min(float(self.protect.max_limit), max(float(self.protect.min_limit), new))
        self.shrinking = self.shrinking + 1 if self.seen > self.reference() and new <= self.limit else 0
        self.limit = new
        if now >= self.next_probe or self.shrinking >= SHRINKING_WINDOWS:
            self.probing, self.shrinking = True, 0

    def reference(self) -> float:
        unloaded = self.unloaded or 0.0
        target = self.protect.target if self.protect.target is not None else math.inf
        return max(unloaded * BUFFER, min(target, unloaded * TOLERANCE))


class Fleet:
    """The Redis side of a fleet-wide limit (lua/protect.lua): its keys, and the leases of its slots."""

    def __init__(self, limiter: Limiter, prefix: str, upstream: str, route: str, lease: float) -> None:
        self.limiter = limiter
        self.slots, self.state = protect_keys(prefix, upstream, route)
        self.route = route
        self.lease_us = max(1000, int(lease * 1_000_000))
        self.leases = Leases(limiter)
        self.pending: set[asyncio.Task[None]] = set()
        self.down = False  # the last call failed: this worker counts its own requests meanwhile

    async def take(self, share: float, limit: float, min_limit: int) -> tuple[Lease | None, int, float, float]:
        """A slot (its lease; None: refused), the fleet's requests in flight, its limit and the limit in force."""
        token = new_token()
        call = self.limiter.protect(
            [self.slots, self.state],
            [b"take", token, round(share * 1000), self.lease_us, round(limit * 1000), min_limit])
        ok, count, limit_k, in_force_k = await kept(call, partial(self._abandoned, token))
        lease = self._lease(token) if ok else None
        if lease is not None:
            self.leases.hold(lease)
        return lease, count, limit_k / 1000, in_force_k / 1000

    def _lease(self, token: bytes) -> Lease:
        return Lease(token, self.route, ["protect"], [self.slots], [1], [self.lease_us])

    def _abandoned(self, token: bytes, call: asyncio.Future[list[int]]) -> None:
        if not call.cancelled() and call.exception() is None and call.result()[0]:
            self.leases.release(self._lease(token))

    def step(self, controller: Controller, window: float, probe: bool) -> None:
        """Propose the controller's new limit to the fleet; the limit the fleet holds comes back to it."""
        task = asyncio.get_running_loop().create_task(self._step(controller, window, probe))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _step(self, controller: Controller, window: float, probe: bool) -> None:
        try:
            _, limit_k = await self.limiter.protect(
                [self.slots, self.state],
                [b"step", round(controller.limit * 1000), int(window * 1_000_000), int(probe)])
        except RedisUnavailable:
            return  # the next window proposes again
        controller.limit = limit_k / 1000

    async def drain(self) -> None:
        await self.leases.drain()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


class Guard:
    """One protected upstream (or route) in this worker: its controller, and the requests in flight
    (with `fleet`: the fleet's, counted in Redis)."""

    def __init__(self, protect: Protect, upstream: str, route: str = "*",
                 clock: Callable[[], float] = time.monotonic, fleet: Fleet | None = None) -> None:
        self.protect = protect
        self.upstream = upstream
        self.route = route  # "*": every route to the upstream without a protect: of its own
        self.clock = clock
        self.fleet = fleet
        self.controller = Controller(protect, clock())
        self.in_flight = 0  # this worker's (fleet-wide: the fleet's is counted in Redis)
        self.shedding = False
        self.shed_since_start = 0
        self.waiting: dict[str, collections.deque[asyncio.Future[Slot]]] = {}  # per priority: its queue
        self.queued = 0
        for priority in protect.priorities:
            if priority.queue_size:  # shown at 0 from the start
                metrics.PROTECT_QUEUED.labels(upstream, self.route, priority.name)
        self._limit_gauge = (metrics.PROTECT_FLEET_LIMIT if fleet else metrics.PROTECT_LIMIT).labels(upstream,
                                                                                                    self.route)
        self._seen_gauge = metrics.PROTECT_ANSWER_TIME.labels(upstream, self.route)
        self._show_limit()

    def priority(self, view: RequestView) -> Priority:
        """The first priority whose match the request meets; the last takes the rest."""
        for priority in self.protect.priorities[:-1]:
            if ((priority.methods is None or view.acted_method() in priority.methods)
                    and view.meets_conditions(priority.when)):
                return priority
        return self.protect.priorities[-1]

    async def take(self, priority: Priority, fail_open: bool = True) -> Slot | None:
        """A slot for a request of `priority`, or None: refused, it is to be answered 503. Fleet-wide
        with Redis unavailable: RedisUnavailable unless `fail_open`, which counts this worker's own."""
        if self.fleet is None:
            if priority.queue_size and not self._free_for(priority):
                return await self._wait(priority)
            return self.take_here(priority)
        try:
            lease, count, limit, in_force = await self.fleet.take(priority.share, self.controller.limit,
                                                                   self.protect.min_limit)
        except RedisUnavailable as exc:
            self._fleet_down(exc)
            if not fail_open:
                raise
            return self.take_here(priority)
        if self.fleet.down:
            self.fleet.down = False
            log.warning("upstream '%s' (routes %s): Redis answers again; the fleet's limit applies",
                        self.upstream, self.route)
        if limit != self.controller.limit:
            self.controller.limit = limit
            self._show_limit()
        self.controller.busiest = max(self.controller.busiest, count)
        if lease is None:
            self._shed(priority, in_force, count)
            return None
        self.in_flight += 1
        return Slot(self, priority, lease)

    def take_here(self, priority: Priority) -> Slot | None:
        """A slot counted in this worker alone."""
        if not self._free_for(priority):
            self._shed(priority, self.controller.in_force, self.in_flight)
            return None
        return self._grant(priority)

    def _fits(self, priority: Priority) -> bool:
        return not self.in_flight or self.in_flight < self.controller.in_force * priority.share

    def _free_for(self, priority: Priority) -> bool:
        """A place fits the priority's share, and no request as important or more waits for one."""
        if not self._fits(priority):
            return False
        if self.queued:
            for waiting in self.protect.priorities:
                if self.waiting.get(waiting.name):
                    return False
                if waiting.name == priority.name:
                    break
        return True

    def _grant(self, priority: Priority) -> Slot:
        self.in_flight += 1
        self.controller.busiest = max(self.controller.busiest, self.in_flight)
        return Slot(self, priority)

    async def _wait(self, priority: Priority) -> Slot | None:
        """Wait in the priority's queue for a place, until its timeout: the slot, or None (refused)."""
        queue = self.waiting.setdefault(priority.name, collections.deque())
        if len(queue) >= priority.queue_size:
            self._shed(priority, self.controller.in_force, self.in_flight)
            return None
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        queue.append(future)
        self.queued += 1
        gauge = metrics.PROTECT_QUEUED.labels(self.upstream, self.route, priority.name)
        gauge.inc()
        try:
            async with asyncio.timeout(priority.queue_timeout):  # (3.11's wait_for can drop a cancel)
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done():  # given a place as its time ran out
                return future.result()
            self._shed(priority, self.controller.in_force, self.in_flight)
            return None
        except asyncio.CancelledError:  # the client left while it waited
            if future.done() and not future.cancelled():
                future.result().release()
            raise
        finally:
            if not future.done():
                future.cancel()
            if future in queue:
                queue.remove(future)
            self.queued -= 1
            gauge.dec()

    def _wake(self) -> None:
        """Places free: to the waiters, the most important priority first, each queue in arrival order."""
        for priority in self.protect.priorities:
            queue = self.waiting.get(priority.name)
            while queue and self._fits(priority):
                future = queue.popleft()
                if not future.done():
                    future.set_result(self._grant(priority))

    def _fleet_down(self, exc: RedisUnavailable) -> None:
        assert self.fleet is not None
        if not self.fleet.down:
            self.fleet.down = True
            log.warning("upstream '%s' (routes %s): Redis unavailable (%s): the fleet's limit is out of reach; "
                        "routes follow their failure_mode (open: this worker's own count, limit %d)",
                        self.upstream, self.route, exc.kind, self.controller.in_force)

    def _shed(self, priority: Priority, limit: float, in_flight: int) -> None:
        self.controller.refused += 1
        self.shed_since_start += 1
        metrics.protect_shed(self.upstream, self.route, priority.name).inc()
        if not self.shedding:
            self.shedding = True
            log.warning("upstream '%s' (routes %s): shedding starts with priority '%s'; limit %d%s, %d in "
                        "flight, answer time p%d %s (unloaded %s)", self.upstream, self.route, priority.name,
                        limit, " (the fleet's)" if self.fleet else "", in_flight, self.protect.percentile,
                        _ms(self.controller.seen), _ms(self.controller.unloaded))

    def _release(self, seconds: float | None, dropped: bool, lease: Lease | None) -> None:
        self.in_flight -= 1
        if lease is not None:
            assert self.fleet is not None
            self.fleet.leases.release(lease)
        now = self.clock()
        refused = self.controller.refused
        if dropped:
            closed = self.controller.drop(now)
        elif seconds is not None:
            closed = self.controller.sample(seconds, now)
        else:
            return
        if not closed:
            return
        if self.fleet is not None and not self.fleet.down:
            self.fleet.step(self.controller, self.controller.window(), self.controller.probing)
        self._show_limit()
        if self.controller.seen is not None:
            self._seen_gauge.set(self.controller.seen)
        if self.shedding and refused == 0:
            self.shedding = False
            log.warning("upstream '%s' (routes %s): shedding stops after %d requests refused; limit %d",
                        self.upstream, self.route, self.shed_since_start, self.controller.limit)
            self.shed_since_start = 0

    def _show_limit(self) -> None:
        self._limit_gauge.set(self.controller.limit)

    async def drain(self) -> None:
        """The last slots' give-backs and the last proposal reach Redis (at shutdown)."""
        if self.fleet is not None:
            await self.fleet.drain()


class Slot:
    """One request's place in flight. `answered` or `timed_out` says how its exchange went; `release`
    gives the place back once, however the request ended (a place given back without either, as for a
    request its rules refused, teaches the controller nothing)."""

    __slots__ = ("dropped", "guard", "lease", "priority", "released", "seconds")

    def __init__(self, guard: Guard, priority: Priority, lease: Lease | None = None) -> None:
        self.guard = guard
        self.priority = priority
        self.lease = lease  # fleet-wide: the slot in Redis
        self.seconds: float | None = None
        self.dropped = False
        self.released = False

    def answered(self, status: int, seconds: float) -> None:
        if status in (503, 504):  # the upstream's own overload signal
            self.dropped = True
        elif status < 500:
            self.seconds = seconds

    def timed_out(self) -> None:
        self.dropped = True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.guard._release(self.seconds, self.dropped, self.lease)
            if self.guard.queued:
                self.guard._wake()


def shed_answer_fields(guard: Guard, priority: Priority, route: str) -> tuple[str, dict[str, object]]:
    """The detail and the extra members of a refusal's problem+json."""
    detail = (f"upstream '{guard.upstream}' is at its limit of requests in flight; priority "
              f"'{priority.name}' is refused first")
    return detail, {"route": route, "priority": priority.name, "retry_after_ms": RETRY_AFTER * 1000}


def guards_for(routes: Iterable[Route], before: Mapping[str, Guard], limiter: Limiter | None = None,
               prefix: str = "") -> dict[str, Guard]:
    """Per route name, the guard its requests take a slot from: its own, or its upstream's (shared).
    A guard of `before` (the configuration replaced) for the same upstream, route and `protect:` (and,
    fleet-wide, the same Redis) is kept: its limit, what it has measured, and the requests still in
    flight through it. Without `limiter`, a fleet-wide protect: counts per worker."""
    kept = {(g.upstream, g.route, g.protect): g for g in before.values()
            if g.fleet is None or g.fleet.limiter is limiter}
    out: dict[str, Guard] = {}
    for route in routes:
        upstream = route.upstream
        if upstream is None or (route.protect or upstream.protect) is None:
            continue
        protect, name = (route.protect, route.name) if route.protect is not None else (upstream.protect, "*")
        assert protect is not None
        key = (upstream.name, name, protect)
        guard = kept.get(key)
        if guard is None:
            fleet = None
            if protect.scope == "fleet" and limiter is not None:
                fleet = Fleet(limiter, prefix, upstream.name, name, protect.lease)
            guard = kept[key] = Guard(protect, upstream.name, name, fleet=fleet)
        out[route.name] = guard
    return out


def _percentile(ordered: list[float], percentile: int) -> float:
    return ordered[min(len(ordered) - 1, len(ordered) * percentile // 100)]


def _jittered(seconds: float) -> float:
    return seconds * random.uniform(0.8, 1.2)


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1000:.0f}ms"
