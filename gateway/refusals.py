"""Refusals answered from this worker's memory until Redis would stop refusing (issue 13).

A refusal Redis gave is kept, keyed by everything the decision read: the keys of every rule of the
route (a rule sitting out has its route/rule prefix there) and every rule's cost. While it holds,
the same request is refused from here with the answer Redis would give, and Redis is not asked.
Why it holds, and where it is not kept (docs/algorithms.md, "Refusals from memory"):

- the refusing rule cannot admit this cost before its retry: its state only gets worse with other
  admissions and better only with time, and the refusal is all or nothing, so one rule suffices;
- a cost that can never fit (above the rule's capacity) is refused whatever the state: kept for
  the life of the config (a reload builds a new Runtime, hence a new cache);
- NOT kept: a refusal without retry that a reset lifts (a quota without period), a refusal by a
  leaky_bucket, a route with a shadow rule taking part (its counts stay exact), a refusal whose
  rate-limit fields would drift (the refusing rule's remaining may still grow during the wait).

Time is this process's monotonic clock in integer microseconds. A refusal is held from the moment
the request was SENT to Redis (Redis read its clock after that), for one millisecond less than
the rounded-up retry, less 1000 ppm for the two clocks' rates: it never outlives Redis's refusal.
The retry reported from memory counts down from the moment the reply ARRIVED: never below Redis's.

Bounded: an LRU of `max_entries` (routes.yaml `local_refusals.max_entries`, default 100,000; 0
turns it off). Each worker has its own; an admin reset clears the entries that read the key.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.config import BUCKET_ALGORITHMS, LOCAL_REFUSALS_MAX, Rule
from gateway.limiter import Decision, Outcome, RuleState

__all__ = ["DEFAULT_MAX_ENTRIES", "LocalRefusals", "micros"]

DEFAULT_MAX_ENTRIES = LOCAL_REFUSALS_MAX
NEVER = float("inf")
PPM = 1000  # allowance for the rates of this clock and Redis's (NTP slews at most 500 ppm)

CacheKey = tuple[tuple[str, ...], tuple[int | None, ...]]


def micros() -> int:
    """This process's monotonic clock in whole microseconds."""
    return time.monotonic_ns() // 1000


class _Held:
    """One refusal: until when it holds, and what Redis said, as of when its reply arrived."""

    __slots__ = ("decision", "received", "until")

    def __init__(self, until: float, received: int, decision: Decision) -> None:
        self.until = until          # µs on the local clock; inf: for the life of the config
        self.received = received    # µs on the local clock
        self.decision = decision


class LocalRefusals:
    """The refusals of one Runtime (one config), bounded to `max_entries` (least recently used go)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Callable[[], int] = micros) -> None:
        self.max_entries = max_entries
        self.clock = clock
        self.entries: OrderedDict[CacheKey, _Held] = OrderedDict()
        self.reset_at = -1  # a refusal from a request sent before this may predate a reset

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self.entries)

    def answer(self, keys: Sequence[str], costs: Sequence[int | None]) -> Decision | None:
        """The refusal Redis would give this request now, or None: ask Redis."""
        if not self.entries:
            return None
        cache_key = (tuple(keys), tuple(costs))
        held = self.entries.get(cache_key)
        if held is None:
            return None
        now = self.clock()
        if now >= held.until:
            del self.entries[cache_key]
            return None
        self.entries.move_to_end(cache_key)
        decision = held.decision
        elapsed = now - held.received
        if elapsed <= 0:
            return decision
        retry = decision.retry_after_ms
        if retry is not None:
            retry = max(1, retry - elapsed // 1000)
        by = decision.refused_by
        assert by is not None
        states = list(decision.rules)
        state = states[by]
        if state.reset_ms > 0:
            states[by] = RuleState(state.outcome, state.remaining, max(0, state.reset_ms - elapsed // 1000))
        return Decision(False, by, retry, 0, tuple(states))

    def remember(self, rules: Sequence[Rule], keys: Sequence[str], costs: Sequence[int | None],
                 decision: Decision, sent: int) -> bool:
        """Keep a refusal Redis just gave (`sent`: the clock when the request left for Redis), if
        it holds; `rules` are the rules that took part, in order, as in the Decision. True if kept."""
        if not self.enabled or decision.admitted or decision.refused_by is None or sent <= self.reset_at:
            return False
        until = self._holds_until(rules, costs, decision, sent)
        if until is None:
            return False
        received = self.clock()
        if until <= received:
            return False
        cache_key = (tuple(keys), tuple(costs))
        self.entries[cache_key] = _Held(until, received, decision)
        self.entries.move_to_end(cache_key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
        return True

    @staticmethod
    def _holds_until(rules: Sequence[Rule], costs: Sequence[int | None], decision: Decision,
                     sent: int) -> float | None:
        if any(rule.shadow for rule in rules):
            return None  # shadow rules count what they would do on every request: keep asking
        by = decision.refused_by
        assert by is not None
        rule, state = rules[by], decision.rules[by]
        cost = [c for c in costs if c is not None][by]
        if cost > rule.capacity:
            return NEVER  # refused whatever the state, until the config changes
        retry = decision.retry_after_ms
        if retry is None or state.outcome is not Outcome.REFUSES:
            return None  # no retry: lifted only by a reset (a quota without period)
        if rule.algorithm == "leaky_bucket":
            return None
        steady = rule.algorithm == "fixed_window" or rule.algorithm == "quota"
        if not steady and state.remaining != cost - 1:
            # remaining < cost all through the wait; only at cost - 1 can it not grow meanwhile
            return None
        hold = retry
        if state.reset_ms >= 0 and rule.algorithm not in BUCKET_ALGORITHMS:
            hold = min(hold, state.reset_ms)  # a window's reset starts again when the window ends
        # Redis read its clock after `sent`; its wait was over 1000 * (hold - 1) µs
        span = 1000 * (hold - 1)
        return sent + span - span * PPM // 1_000_000 - 1

    def forget_key(self, key: str) -> int:
        """Drop every refusal that read `key` (an admin reset of it, called once the reset is done);
        refusals of requests in flight meanwhile are not kept either. How many were dropped."""
        self.reset_at = self.clock()
        stale = [k for k in self.entries if key in k[0]]
        for k in stale:
            del self.entries[k]
        return len(stale)

    def clear(self) -> None:
        self.reset_at = self.clock()
        self.entries.clear()
