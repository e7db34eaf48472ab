"""Counting by the answer: what an admitted request still owes, or is owed, once its answer comes.

A rule with `count_on` or `cost: response_header:NAME` is checked at admission (it refuses while
its budget is spent) but charged only when the answer's head arrives: for a listed status, or by
the cost the upstream declares. A rule with `refund_on` gives back the units it charged at
admission when the answer has a listed status (the gateway's own 502/504 included; a client gone
before the answer counts as the 499 logged). All of a request's charges and refunds leave in ONE
script call (the route's settling script: every rule takes its cost, whatever its room), sent in
the background: the response never waits for it, and the Redis runner puts the calls of one
event-loop tick in one batch. A request settles at most once.

Charging after the answer cannot be atomic with the check: with N requests of one identity in
flight when its budget runs out, at most N are admitted beyond it (docs/algorithms.md).

A refund must land in the window it was charged in: a window algorithm's refund is dropped when
the window may have ended before it arrives (the count is gone with the window anyway), so a refund
never takes units from the next window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway import metrics
from gateway.config import Algorithm
from gateway.errors import RedisUnavailable
from gateway.limiter import Decision, Limiter, RuleSpec
from gateway.refusals import LocalRefusals
from gateway.response_cost import charge

if TYPE_CHECKING:
    from gateway.plan import RoutePlan

log = logging.getLogger("gateway.settlement")

NEVER = float("inf")
CLOCK_RATE = 0.001  # this clock's and Redis's rates may differ by this much (NTP slews at most 500 ppm)


class Settlement:
    """One admitted request's rules that count by the answer: its keys, what admission charged,
    and until when (this process's monotonic clock) each refund still lands in its window."""

    __slots__ = ("charged", "deadlines", "keys", "plan", "settle_args", "settled", "shard")

    def __init__(self, plan: RoutePlan, shard: int, keys: list[str], costs: list[int | None],
                 decision: Decision, margin: float) -> None:
        self.plan = plan
        self.shard = shard
        self.keys = keys
        self.charged = costs
        self.settled = False
        self.settle_args: tuple[RuleSpec, ...] | None = None  # an identity's overrides: its own numbers
        now = time.monotonic()
        deadlines: list[float] = []
        states = iter(decision.rules)
        for rule, cost in zip(plan.rules, costs, strict=True):
            if cost is None:
                deadlines.append(NEVER)
                continue
            state = next(states)
            if (rule.refund_on or rule.settle_field) and _windowed(rule.algorithm, rule.window) and state.reset_ms >= 0:
                reset = state.reset_ms / 1000
                deadlines.append(now + reset - reset * CLOCK_RATE - margin)
            else:
                deadlines.append(NEVER)
        self.deadlines = deadlines

    def owed(self, status: int, declared: Mapping[str, str] | None,
             usage: Mapping[tuple[str, ...], int] | None = None) -> list[int | None] | None:
        """Per rule of the route: units to charge (> 0), to give back (< 0), or None; None when
        the answer changes nothing. `declared`: the answer's fields (None: the gateway's own);
        `usage`: what a whole answer said it used, by path (token budgets; absent: the reserve stands)."""
        out: list[int | None] = []
        now = time.monotonic()
        for rule, cost, deadline in zip(self.plan.rules, self.charged, self.deadlines, strict=True):
            amount: int | None = None
            if cost is None:
                pass
            elif rule.settle_field is not None and usage and rule.settle_field in usage:
                amount = min(usage[rule.settle_field], rule.capacity) - cost  # up, or down while it lands
                if amount < 0 and now >= deadline:
                    amount = None
            elif rule.charged_after:
                if not rule.count_on or status in rule.count_on:
                    amount = cost if rule.cost_response_header is None else charge(
                        declared, rule.cost_response_header, rule.capacity, self.plan.route, rule.name, status)
                    if amount is not None:
                        amount = min(amount, rule.capacity)  # past its capacity a rule is spent all the same
            elif status in rule.refund_on and now < deadline:
                amount = -cost
            out.append(amount or None)
        return out if any(amount is not None for amount in out) else None


def _windowed(algorithm: str, window: float) -> bool:
    """Whether the rule's count belongs to a window that ends (a quota without period never does)."""
    return algorithm in (Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW) or (
        algorithm == Algorithm.QUOTA and window > 0)


class Settler:
    """Sends settlements in the background and counts the ones Redis could not take."""

    def __init__(self, limiter: Limiter, refusals: LocalRefusals) -> None:
        self.limiter = limiter
        self.refusals = refusals
        self.pending: set[asyncio.Task[None]] = set()

    def settle(self, settlement: Settlement, status: int, declared: Mapping[str, str] | None,
               usage: Mapping[tuple[str, ...], int] | None = None) -> None:
        """Charge and refund what the answer says, once per request; never waits."""
        if settlement.settled:
            return
        settlement.settled = True
        owed = settlement.owed(status, declared, usage)
        if owed is None:
            return
        task = asyncio.get_running_loop().create_task(self._send(settlement, owed))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _send(self, settlement: Settlement, owed: list[int | None]) -> None:
        plan = settlement.plan
        args = settlement.settle_args or plan.shard_settle_args[settlement.shard]
        try:
            await self.limiter.decide(args, settlement.keys, owed)
        except RedisUnavailable as exc:
            for rule, amount in zip(plan.rules, owed, strict=True):
                if amount is not None:
                    kind = "charge" if amount > 0 else "refund"
                    metrics.settle_failures(plan.route.name, rule.name, kind).inc()
                    log.warning("Redis unavailable (%s): route %s rule %s lost a %s of %d after the answer",
                                exc.kind, plan.route.name, rule.name, kind, abs(amount))
            return
        for rule, key, amount in zip(plan.rules, settlement.keys, owed, strict=True):
            if amount is not None:
                metrics.settlements(plan.route.name, rule.name, "charge" if amount > 0 else "refund").inc()
                if amount < 0:
                    self.refusals.forget_key(key)  # a refusal held for it may no longer be Redis's

    async def drain(self) -> None:
        """Wait for the settlements under way (at shutdown)."""
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
