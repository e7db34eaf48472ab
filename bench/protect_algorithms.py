#!/usr/bin/env python3
"""Which rule the protect controller (gateway/protect.py) follows, chosen by measurement: the same
controller (windows, unloaded time, probes, priorities) with four rules for the next limit, each
against the same simulated upstream of fixed capacity (C served at once, the rest queued in order,
service times jittered by a fifth), on a simulated clock, three seeds each:

- gradient: the limit times reference / percentile when slower, at most halved (Envoy's adaptive
  concurrency filter, Netflix's Gradient2), plus its square root when not;
- vegas: keep the queue the answer times imply between 3 and 6 log10(limit) (Netflix's VegasLimit);
- aimd: a tenth off when slower, one more when not (Netflix's AIMDLimit);
- aimd_sqrt, the one the gateway ships: a tenth off when slower, its square root more when not.

(Written for this project after reading those; none of their code.) Scenarios: 3x the capacity of
sheddable requests and 20% of critical ones, from a cold start, in steady state, with the service
time doubling, with the capacity growing fourfold, and for 10 minutes (does the unloaded time drift?).
Prints a Markdown table (docs/algorithms.md, "Protecting the upstream"):

    python bench/protect_algorithms.py [RULE ...]
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import Priority, Protect
from gateway.protect import Guard, Rule, Slot, aimd_sqrt

CAPACITY = 4
SERVICE = 0.1
RATE = CAPACITY / SERVICE


def vegas(limit: float, seen: float, unloaded: float, reference: float, dropped: bool, in_use: bool) -> float:
    """Estimate the requests queued at the upstream from how much slower than unloaded the answers
    are; keep it between 3 and 6 log10(limit), and under the reference."""
    if dropped or seen > reference:
        return limit - max(1.0, math.log10(limit))
    queued = limit * (1 - unloaded / seen)
    log = max(1.0, math.log10(limit))
    if queued <= log:
        return limit + 6 * log if in_use else limit
    if queued < 3 * log:
        return limit + log if in_use else limit
    if queued > 6 * log:
        return limit - log
    return limit


def aimd(limit: float, seen: float, unloaded: float, reference: float, dropped: bool, in_use: bool) -> float:
    """Add one while the answers are within the reference, take a tenth off when they are not."""
    if dropped or seen > reference:
        return limit * 0.9
    return limit + 1 if in_use else limit


def gradient(limit: float, seen: float, unloaded: float, reference: float, dropped: bool, in_use: bool) -> float:
    """Multiply the limit by reference / percentile when the answers are slower (at most halving it),
    add its square root while they are not."""
    if dropped:
        return limit / 2
    ratio = reference / seen
    if ratio < 1:
        return limit * max(0.5, ratio)
    return limit + math.sqrt(limit) if in_use else limit


RULES: dict[str, Rule] = {"gradient": gradient, "vegas": vegas, "aimd": aimd, "aimd_sqrt": aimd_sqrt}
PROTECT = Protect((Priority("critical", 1.0), Priority("sheddable", 0.5)), target=None)


@dataclass
class Upstream:
    capacity: int
    service: float
    busy: int = 0
    queue: deque[tuple[float, int]] = field(default_factory=deque)
    served: int = 0


@dataclass
class Result:
    critical: list[tuple[float, float]] = field(default_factory=list)  # (sent at, answer time)
    critical_refused: int = 0
    critical_sent: int = 0
    limits: list[tuple[float, float]] = field(default_factory=list)
    served: list[float] = field(default_factory=list)                  # when each answer was served


def simulate(rule: Rule, seconds: float, slow_at: float | None = None, seed: int = 1,
             grow_at: float | None = None) -> tuple[Result, Guard]:
    rng = random.Random(seed)
    random.seed(seed)  # the controller's probe jitter
    now = [0.0]
    guard = Guard(PROTECT, "sim", "sim", clock=lambda: now[0])
    guard.controller.rule = rule
    upstream = Upstream(CAPACITY, SERVICE)
    result = Result()
    events: list[tuple[float, int, str, object]] = []
    order = iter(range(10**9))
    slots: dict[int, tuple[Slot, float, bool]] = {}

    def push(at: float, kind: str, data: object) -> None:
        heapq.heappush(events, (at, next(order), kind, data))

    def start(request: int) -> None:
        upstream.busy += 1
        push(now[0] + upstream.service * rng.uniform(0.8, 1.2), "done", request)

    offered = 4.0 if grow_at is not None else 1.0  # 3x the capacity, or 3x its fourfold
    push(0.0, "sheddable", None)
    push(0.0, "critical", None)
    critical, sheddable = guard.protect.priorities
    while events:
        at, _, kind, data = heapq.heappop(events)
        if at > seconds and kind != "done":
            continue
        now[0] = at
        if slow_at is not None and at >= slow_at:
            upstream.service = 2 * SERVICE
        if grow_at is not None and at >= grow_at and upstream.capacity == CAPACITY:
            upstream.capacity = 4 * CAPACITY
            while upstream.queue and upstream.busy < upstream.capacity:
                start(upstream.queue.popleft()[1])
        if kind in ("sheddable", "critical"):
            priority = critical if kind == "critical" else sheddable
            push(at + rng.expovariate((0.2 if kind == "critical" else 3.0 * offered) * RATE), kind, None)
            result.critical_sent += kind == "critical"
            slot = guard.take_here(priority)
            if slot is None:
                result.critical_refused += kind == "critical"
                continue
            request = next(order)
            slots[request] = (slot, at, kind == "critical")
            if upstream.busy < upstream.capacity:
                start(request)
            else:
                upstream.queue.append((at, request))
        elif kind == "done":
            assert isinstance(data, int)
            upstream.busy -= 1
            upstream.served += 1
            result.served.append(at)
            slot, sent, is_critical = slots.pop(data)
            slot.answered(200, at - sent)
            slot.release()
            if is_critical:
                result.critical.append((sent, at - sent))
            result.limits.append((at, guard.controller.limit))
            if upstream.queue:
                start(upstream.queue.popleft()[1])
    return result, guard


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(len(ordered) * 0.9)] if ordered else math.nan


def summary(result: Result, start: float, end: float, service: float) -> tuple[float, float, float, float]:
    """(goodput / capacity, critical p90 / service time, critical refused %, limit's coefficient of variation)"""
    served = sum(start <= t < end for t in result.served) / (end - start)
    critical = [seconds for sent, seconds in result.critical if start <= sent < end]
    limits = [limit for t, limit in result.limits if start <= t < end]
    spread = statistics.pstdev(limits) / statistics.mean(limits) if limits else math.nan
    refused = 100 * result.critical_refused / max(1, result.critical_sent)
    return served / (CAPACITY / service), p90(critical) / service, refused, spread


def quiet() -> None:
    logging.getLogger("gateway.protect").setLevel(logging.ERROR)


# (name, seconds, simulate's keywords, the window read, the service time then, its capacity)
SCENARIOS: tuple[tuple[str, float, dict[str, float], tuple[float, float], float, int], ...] = (
    ("overload from a cold start: its first 4 s (10 windows)", 60.0, {}, (0.0, 4.0), SERVICE, 1),
    ("overload, 10-60 s", 60.0, {}, (10.0, 60.0), SERVICE, 1),
    ("service time doubles at 30 s: 30-40 s", 60.0, {"slow_at": 30.0}, (30.0, 40.0), 2 * SERVICE, 1),
    ("capacity x4 at 30 s (12x offered): 30-40 s", 60.0, {"grow_at": 30.0}, (30.0, 40.0), SERVICE, 4),
    ("10 min of overload: 540-600 s", 600.0, {}, (540.0, 600.0), SERVICE, 1),
)
SEEDS = (1, 2, 3)


def main() -> None:
    quiet()
    print("| rule | scenario | goodput / capacity | critical p90 / service time | critical refused | "
          "limit's spread (stdev / mean) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rule in RULES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        for scenario, seconds, keywords, (start, end), service, scale in SCENARIOS:
            rows = []
            for seed in SEEDS:
                result, _ = simulate(rule, seconds, seed=seed, **keywords)
                goodput, p90_, refused, spread = summary(result, start, end, service)
                rows.append((goodput / scale, p90_, refused, spread))
            mean = [statistics.mean(column) for column in zip(*rows, strict=True)]
            print("| {} | {} | {:.2f} | {:.2f} | {:.1f}% | {:.2f} |".format(name, scenario, *mean))


if __name__ == "__main__":
    main()
