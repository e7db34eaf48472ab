"""Refusals answered from this worker's memory until Redis would stop refusing.

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
turns it off). Each worker has its own; an admin reset clears the entries that read the key in the
worker that served it. Other workers and hosts never see the reset, so no refusal is held longer
than `max_hold` (`local_refusals.max_hold`, default 1 s): after that Redis is asked again, and
a reset reaches every worker within it. Under a flood that is one Redis call per identity per
worker per `max_hold`. Only a cost that can never fit is held longer: no reset changes that.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from gateway.config import BUCKET_ALGORITHMS, LOCAL_REFUSALS_HOLD, LOCAL_REFUSALS_MAX, Algorithm, Rule
from gateway.limiter import Decision, RuleOutcome

__all__ = ["DEFAULT_MAX_ENTRIES", "LocalRefusals", "micros"]

DEFAULT_MAX_ENTRIES = LOCAL_REFUSALS_MAX
NEVER = float("inf")
COSTS_PER_IDENTITY = 4  # refusals of different costs kept per identity (the newest)
LET_PASS = 8  # turns of the event loop an answer from memory lets pass before it goes out
PPM = 1000  # allowance for the rates of this clock and Redis's (NTP slews at most 500 ppm)

Keys = tuple[str, ...]
Costs = tuple[int | None, ...]


def micros() -> int:
    """This process's monotonic clock in whole microseconds."""
    return time.monotonic_ns() // 1000


class _Held:
    """One refusal of one identity at one cost: until when it holds, and each rule's state as Redis
    said it when its reply arrived (the rate-limit fields name every rule, not only the refusing
    one). Refusals of other costs of the same identity chain on through `other`. Plain slots, no
    Decision kept.

    Past `until` an entry stays as a marker: the identity was refused lately, so of the requests
    arriving together only one (the probe) asks Redis, the others wait for its answer."""

    __slots__ = ("admitted_probes", "by", "costs", "other", "probe", "received", "retry", "states", "until")

    def __init__(self, costs: Costs, until: float, received: int, decision: Decision,
                 other: _Held | None) -> None:
        by = decision.refused_by
        assert by is not None
        self.costs = costs
        self.until = until          # µs on the local clock; inf: for the life of the config
        self.received = received    # µs on the local clock
        self.by = by
        self.retry = decision.retry_after_ms
        self.states = decision.rules
        self.other = other
        self.probe: asyncio.Future[None] | None = None
        self.admitted_probes = 0

    def answer(self, now: int) -> Decision:
        """What Redis would answer now: the same refusal, its retry and every rule's reset counted
        down (what is left stays: nothing was admitted on these keys meanwhile, or they would be
        forgotten)."""
        elapsed = (now - self.received) // 1000 if now > self.received else 0
        retry = self.retry
        if retry is not None:
            retry = max(1, retry - elapsed)
        states = tuple(state if state.reset_ms <= 0 else state._replace(reset_ms=max(0, state.reset_ms - elapsed))
                       for state in self.states)
        return Decision(False, self.by, retry, 0, states)


class LocalRefusals:
    """The refusals of one Runtime (one config), per identity (the keys of a request's rules, all
    of them: the answer names the rule with the longest wait), each cost refused; at most
    `max_entries` identities, the least recently used go first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_hold: float = LOCAL_REFUSALS_HOLD,
                 clock: Callable[[], int] = micros) -> None:
        self.max_entries = max_entries
        self.max_hold = round(max_hold * 1_000_000)  # µs
        self.clock = clock
        self.entries: OrderedDict[Keys, _Held] = OrderedDict()
        self.reset_at = -1  # a refusal from a request sent before this may predate a reset

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self.entries)

    async def decide(self, rules: Sequence[Rule], keys: Sequence[str], costs: Sequence[int | None],
                     ask: Callable[[], Awaitable[Decision]]) -> tuple[Decision, bool]:
        """The decision for this request: from memory (True) while a refusal holds, else `ask()`'s
        (Redis's, False), kept if it is a refusal that holds. `rules` are those taking part, in
        order, as in the Decision; `keys` and `costs` are the route's, as given to the Limiter.

        Under a flood, when a held refusal runs out the requests arriving together would all ask
        Redis at once: one asks (the probe), the others wait for its answer and then look again.
        Redis errors pass through (the caller's failure policy applies).

        An answer from memory lets LET_PASS turns of the event loop pass before it is returned.
        It is done in one turn, while an admitted request needs several (Redis's reply, the
        upstream's): under a flood every turn would carry one refusal per flooding connection and
        an honest request would wait that long at each of its turns (bench/flood.py: honest p50
        18.6 ms with no turns, 5.2 ms with 8, 5.4 ms with memory off; refusals per second alike).
        Spread over several turns, the flood leaves each turn short."""
        if not self.enabled:
            return await ask(), False
        identity, cost = tuple(keys), tuple(costs)
        probing: _Held | None = None
        while self.entries:
            held = self._find(identity, cost)
            if held is None:
                break
            now = self.clock()
            if now < held.until:
                self.entries.move_to_end(identity)
                answer = held.answer(now)
                for _ in range(LET_PASS):  # honest requests first (see the docstring)
                    await asyncio.sleep(0)
                return answer, True
            if held.probe is None:
                probing = held
                held.probe = asyncio.get_running_loop().create_future()
                break
            await asyncio.shield(held.probe)
        sent = self.clock()
        try:
            decision = await ask()
            self.answered(rules, keys, costs, decision, sent, probing)
            return decision, False
        finally:
            if probing is not None:
                waiting, probing.probe = probing.probe, None
                if waiting is not None:
                    waiting.set_result(None)

    def answer(self, keys: Sequence[str], costs: Sequence[int | None]) -> Decision | None:
        """The refusal Redis would give this request now, or None: ask Redis."""
        if not self.entries:
            return None
        identity = tuple(keys)
        held = self._find(identity, tuple(costs))
        if held is None:
            return None
        now = self.clock()
        if now >= held.until:
            return None
        self.entries.move_to_end(identity)
        return held.answer(now)

    def admitted(self, keys: Sequence[str]) -> None:
        """Redis admitted a request on these keys (a cheaper one): the refusals held for them still
        hold, but the remaining they report has changed; forget them."""
        if self.entries:
            self.entries.pop(tuple(keys), None)

    def quiet(self) -> bool:
        """Is nothing held? Then a request asks Redis and needs no `decide` around it: `answered`
        after Redis's answer (sent at `clock()`) does what `decide` would."""
        return not self.entries

    def answered(self, rules: Sequence[Rule], keys: Sequence[str], costs: Sequence[int | None], decision: Decision,
                 sent: int, probing: _Held | None = None) -> None:
        """Redis's answer to a request sent at `sent`: a refusal is kept if it holds; an admission
        ends what was held for its identity."""
        if decision.admitted:
            if self.entries:
                self._admitted(tuple(keys), probing)
        else:
            # a refusal too short to hold (its last millisecond) leaves the marker: those
            # arriving meanwhile still ask one at a time, not all at once
            self.remember(rules, keys, costs, decision, sent)

    def _admitted(self, identity: Keys, probing: _Held | None) -> None:
        if not self.entries:
            return
        self.entries.pop(identity, None)
        if probing is not None and probing.admitted_probes == 0:
            # the first probe admitted after a refusal: the next one is likely refused again
            # (a bucket refilled by one); keep the marker for one more probe
            probing.admitted_probes, probing.other, probing.until = 1, None, -1
            self.entries[identity] = probing
            self._bound()

    def _find(self, identity: Keys, cost: Costs) -> _Held | None:
        held = self.entries.get(identity)
        while held is not None and held.costs != cost:
            held = held.other
        return held

    def _forget(self, identity: Keys, gone: _Held) -> None:
        first = self.entries.get(identity)
        if first is None:
            return
        if first is gone:
            if gone.other is None:
                del self.entries[identity]
            else:
                self.entries[identity] = gone.other
            return
        held = first
        while held.other is not None and held.other is not gone:
            held = held.other
        if held.other is gone:
            held.other = gone.other

    def _bound(self) -> None:
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def remember(self, rules: Sequence[Rule], keys: Sequence[str], costs: Sequence[int | None],
                 decision: Decision, sent: int) -> bool:
        """Keep a refusal Redis just gave (`sent`: the clock when the request left for Redis), if
        it holds; `rules` are the rules that took part, in order, as in the Decision. True if kept."""
        if not self.enabled or decision.admitted or decision.refused_by is None or sent <= self.reset_at:
            return False
        until = self._holds_until(rules, costs, decision, sent)
        if until is None:
            return False
        if until != NEVER:
            until = min(until, sent + self.max_hold)  # an admin reset elsewhere reaches us by then
        received = self.clock()
        if until <= received:
            return False
        identity, cost = tuple(keys), tuple(costs)
        old = self._find(identity, cost)
        if old is not None:
            self._forget(identity, old)
        first = self.entries.get(identity)
        if first is not None:  # a few costs per identity at most: header costs are the client's
            held, n = first, 1
            while held.other is not None and n < COSTS_PER_IDENTITY - 1:
                held, n = held.other, n + 1
            held.other = None
        self.entries[identity] = _Held(cost, until, received, decision, first)
        self.entries.move_to_end(identity)
        self._bound()
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
        if retry is None or state.outcome is not RuleOutcome.REFUSES:
            return None  # no retry: lifted only by a reset (a quota without period)
        if rule.algorithm in (Algorithm.LEAKY_BUCKET, Algorithm.CONCURRENCY):
            return None  # a concurrency slot may come back at any moment
        steady = rule.algorithm in (Algorithm.FIXED_WINDOW, Algorithm.QUOTA)
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
        stale = [k for k in self.entries if key in k]
        for k in stale:
            del self.entries[k]
        return len(stale)

    def clear(self) -> None:
        self.reset_at = self.clock()
        self.entries.clear()
