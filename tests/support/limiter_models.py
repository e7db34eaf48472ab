"""Plain-Python models of the seven algorithms' promises (SPEC §2), in integer microseconds.

Each model answers one request the way the contract says the algorithm must: admitted or not,
how long until the same request alone would be admitted (searched for, not derived from the Lua
formulas), the leaky bucket's delay, remaining and reset. `Route` combines rules all or nothing.
They know nothing of Redis; the tests hold the engine to them decision by decision.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction

from gateway.config import BUCKET_ALGORITHMS, Rule

NEVER = -1


@dataclass
class Answer:
    admitted: bool
    retry_us: int       # NEVER: can never fit (or never refills); 0 when admitted
    delay_us: int       # leaky_bucket: how long the admitted request waits
    remaining: int
    reset_us: int       # NEVER: never resets


def step_us(rule: Rule) -> int:
    """A bucket's emission interval in whole microseconds: 1e6/rate rounded up (never above the rate)."""
    interval = float(repr(1_000_000 / rule.rate))
    return max(1, math.ceil(interval - 1e-6))


def window_us(rule: Rule) -> int:
    return round(rule.window * 1_000_000)


class Model:
    rule: Rule

    def answer(self, t: int, cost: int) -> Answer:
        """What the rule says at time t, without changing anything."""
        raise NotImplementedError

    def take(self, t: int, cost: int) -> None:
        """Record an admission of `cost` at t."""
        raise NotImplementedError

    def charge(self, t: int, cost: int) -> None:
        """A charge after the answer (gateway/settlement.py): taken whatever the room."""
        self.take(t, cost)

    def give(self, t: int, cost: int) -> None:
        """A refund after the answer: `cost` units back, never below an untouched state."""
        raise NotImplementedError

    def admits(self, t: int, cost: int) -> bool:
        return self.answer(t, cost).admitted

    def first_admission(self, t: int, cost: int, horizon: int) -> int | None:
        """The smallest r >= 1 (µs) after which the same request alone is admitted, by search.
        Every algorithm's room only grows with time when nothing is admitted, so the predicate is
        monotonic and a binary search finds the edge."""
        if not self.admits(t + horizon, cost):
            return None
        lo, hi = 0, horizon  # not admitted at t + lo, admitted at t + hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.admits(t + mid, cost):
                hi = mid
            else:
                lo = mid
        return hi


@dataclass
class FixedWindow(Model):
    rule: Rule
    counts: Counter[int] = field(default_factory=Counter)

    @property
    def size(self) -> int:
        return window_us(self.rule)

    def answer(self, t: int, cost: int) -> Answer:
        limit, size = self.rule.limit, self.size
        wid = t // size
        used = self.counts[wid]
        reset = (wid + 1) * size - t
        if cost <= limit and used + cost <= limit:
            return Answer(True, 0, 0, limit - used - cost, reset)
        return Answer(False, NEVER if cost > limit else reset, 0, max(0, limit - used), reset)

    def take(self, t: int, cost: int) -> None:
        self.counts[t // self.size] += cost

    def give(self, t: int, cost: int) -> None:
        wid = t // self.size  # the window the refund lands in (the gateway sends none to a later one)
        self.counts[wid] = max(0, self.counts[wid] - cost)


@dataclass
class Quota(Model):
    """Without a period: at most `limit` in total, ever."""

    rule: Rule
    used: int = 0

    def answer(self, t: int, cost: int) -> Answer:
        limit = self.rule.limit
        if self.used + cost <= limit:
            return Answer(True, 0, 0, limit - self.used - cost, NEVER)
        return Answer(False, NEVER, 0, max(0, limit - self.used), NEVER)

    def take(self, t: int, cost: int) -> None:
        self.used += cost

    def give(self, t: int, cost: int) -> None:
        self.used = max(0, self.used - cost)


@dataclass
class SlidingLog(Model):
    """At most `limit` units in any window (t - window, t]."""

    rule: Rule
    units: list[int] = field(default_factory=list)

    def answer(self, t: int, cost: int) -> Answer:
        limit, size = self.rule.limit, window_us(self.rule)
        inside = sorted(u for u in self.units if u > t - size)
        count = len(inside)
        reset = inside[0] + size - t if inside else size
        if cost <= limit and count + cost <= limit:
            return Answer(True, 0, 0, limit - count - cost, reset)
        if cost > limit:
            return Answer(False, NEVER, 0, max(0, limit - count), reset)
        leaves = inside[count + cost - limit - 1]  # once this unit leaves, enough room
        return Answer(False, leaves + size - t, 0, max(0, limit - count), reset)

    def take(self, t: int, cost: int) -> None:
        self.units.extend([t] * cost)


@dataclass
class SlidingWindow(Model):
    """Admits iff previous * (window - elapsed) / window + current + cost <= limit."""

    rule: Rule
    counts: Counter[int] = field(default_factory=Counter)

    def admits(self, t: int, cost: int) -> bool:
        return cost <= self.rule.limit and self.estimate(t) + cost <= self.rule.limit

    def estimate(self, t: int) -> Fraction:
        size = window_us(self.rule)
        wid, elapsed = divmod(t, size)
        return Fraction(self.counts[wid - 1] * (size - elapsed), size) + self.counts[wid]

    def answer(self, t: int, cost: int) -> Answer:
        limit, size = self.rule.limit, window_us(self.rule)
        estimate = self.estimate(t)
        reset = size - t % size
        remaining = math.floor(limit - estimate)
        if cost <= limit and estimate + cost <= limit:
            return Answer(True, 0, 0, remaining - cost, reset)
        if cost > limit:
            return Answer(False, NEVER, 0, max(0, remaining), reset)
        retry = self.first_admission(t, cost, 2 * size)
        assert retry is not None
        return Answer(False, retry, 0, max(0, remaining), reset)

    def take(self, t: int, cost: int) -> None:
        self.counts[t // window_us(self.rule)] += cost

    def charge(self, t: int, cost: int) -> None:
        wid = t // window_us(self.rule)  # past the room the window is spent, no more (its stored form)
        self.counts[wid] = min(self.rule.limit, self.counts[wid] + cost)

    def give(self, t: int, cost: int) -> None:
        wid = t // window_us(self.rule)
        self.counts[wid] = max(0, self.counts[wid] - cost)


@dataclass
class TokenBucket(Model):
    """Starts full with `burst`; one token back every step µs (token_bucket and gcra)."""

    rule: Rule
    tat: int = 0  # when the bucket is full again

    def ahead(self, t: int) -> int:
        """How long until the bucket is full."""
        return max(self.tat, t) - t

    def answer(self, t: int, cost: int) -> Answer:
        step, burst = step_us(self.rule), self.rule.burst
        ahead = self.ahead(t)
        tokens = (burst * step - ahead) // step
        if cost <= burst and ahead + cost * step <= burst * step:
            return Answer(True, 0, 0, tokens - cost, ahead + cost * step)
        if cost > burst:
            return Answer(False, NEVER, 0, tokens, ahead)
        return Answer(False, ahead + cost * step - burst * step, 0, tokens, ahead)

    def take(self, t: int, cost: int) -> None:
        self.tat = max(self.tat, t) + cost * step_us(self.rule)

    def charge(self, t: int, cost: int) -> None:
        step = step_us(self.rule)  # past the room the bucket is empty, no more
        self.tat = t + min(self.ahead(t) + cost * step, self.rule.burst * step)

    def give(self, t: int, cost: int) -> None:
        self.tat = t + max(0, self.ahead(t) - cost * step_us(self.rule))


@dataclass
class LeakyBucket(Model):
    """Requests leave one unit every step µs; at most `burst` units wait; a request of cost c takes
    c departure slots and leaves at its first."""

    rule: Rule
    free_at: int = 0  # the next free departure slot

    def answer(self, t: int, cost: int) -> Answer:
        step, burst = step_us(self.rule), self.rule.burst
        ahead = max(self.free_at, t) - t
        room = (burst * step - ahead) // step + 1
        if cost <= burst + 1 and ahead + (cost - 1) * step <= burst * step:
            return Answer(True, 0, ahead, room - cost, ahead + cost * step)
        if cost > burst + 1:
            return Answer(False, NEVER, 0, room, ahead)
        return Answer(False, ahead + (cost - 1) * step - burst * step, 0, room, ahead)

    def take(self, t: int, cost: int) -> None:
        self.free_at = max(self.free_at, t) + cost * step_us(self.rule)


def model_for(rule: Rule) -> Model:
    if rule.algorithm == "fixed_window" or (rule.algorithm == "quota" and rule.window > 0):
        return FixedWindow(rule)
    if rule.algorithm == "quota":
        return Quota(rule)
    if rule.algorithm == "sliding_log":
        return SlidingLog(rule)
    if rule.algorithm == "sliding_window":
        return SlidingWindow(rule)
    if rule.algorithm == "leaky_bucket":
        return LeakyBucket(rule)
    assert rule.algorithm in BUCKET_ALGORITHMS
    return TokenBucket(rule)


@dataclass
class RouteAnswer:
    admitted: bool
    refused_by: int | None
    retry_us: int | None
    delay_us: int
    rules: list[Answer]


class Route:
    """Several rules, all or nothing: admitted only if every enforced rule admits; a refused
    request changes nothing; shadow rules are counted when admitted and never refuse or delay."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self.models = [model_for(r) for r in rules]

    def decide(self, t: int, costs: list[int]) -> RouteAnswer:
        answers = [m.answer(t, c) for m, c in zip(self.models, costs, strict=True)]
        refusing = [i for i, (a, r) in enumerate(zip(answers, self.rules, strict=True))
                    if not a.admitted and not r.shadow]
        if refusing:
            # the refusing rule reported is the one with the longest wait (never beats any wait)
            def wait(i: int) -> float:
                return math.inf if answers[i].retry_us == NEVER else answers[i].retry_us
            worst = max(refusing, key=lambda i: (wait(i), -i))
            retry = answers[worst].retry_us
            # nothing was charged: a rule that would have admitted still has the cost left
            left = [replace(a, remaining=a.remaining + c) if a.admitted else a
                    for a, c in zip(answers, costs, strict=True)]
            return RouteAnswer(False, worst, None if retry == NEVER else retry, 0, left)
        for model, answer, cost in zip(self.models, answers, costs, strict=True):
            if answer.admitted:
                model.take(t, cost)
        delay = max([a.delay_us for a, r in zip(answers, self.rules, strict=True) if a.admitted and not r.shadow],
                    default=0)
        return RouteAnswer(True, None, None, delay, answers)
