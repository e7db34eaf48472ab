"""What the client sees when the gateway answers itself: problem+json and rate-limit headers."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo

from starlette.types import Send

from gateway.calendars import next_reset
from gateway.config import Route, Rule
from gateway.http.problem import PROBLEM, Headers, problem
from gateway.limiter import Decision, RuleOutcome

__all__ = ["PROBLEM", "Headers", "problem", "ratelimit_headers", "refusal", "send_answer"]


async def send_answer(send: Send, response: tuple[int, Headers, bytes]) -> int:
    """Send an answer the gateway makes itself (a refusal, a problem); returns its status."""
    status, headers, body = response
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return status


def _seconds(ms: int) -> int:
    return max(0, math.ceil(ms / 1000))


def most_restrictive(rules: Sequence[Rule], decision: Decision) -> int | None:
    """The rule to name in headers: the refusing one, else the enforced rule with least left."""
    if decision.refused_by is not None:
        return decision.refused_by
    best: int | None = None
    for i, state in enumerate(decision.rules):
        if rules[i].shadow:
            continue
        if best is None:
            best = i
            continue
        current = decision.rules[best]
        if (state.remaining, -state.reset_ms) < (current.remaining, -current.reset_ms):
            best = i
    return best


# Kong's per-window legacy headers (X-RateLimit-Remaining-Minute): a window rule whose window is one
# of these whole units
_UNITS = {1.0: b"second", 60.0: b"minute", 3600.0: b"hour", 86400.0: b"day"}
_WINDOWED = frozenset({"fixed_window", "sliding_window", "sliding_log", "quota"})


class _Policy(NamedTuple):
    """What a rule's headers say whatever the state."""

    policy: bytes  # its RateLimit-Policy item: "name";q=5;w=60
    name: bytes    # the start of its RateLimit item: "name";r=
    quota: bytes   # its X-RateLimit-Limit
    unit: bytes    # its Kong-style window (minute, ...), or b""


def current_period(period: str, zone: str, at: float) -> tuple[float, float]:
    """The calendar period (day, week from Monday, month) of `zone` that `at` is in: its start and
    its end (the next reset), UTC seconds; a month in November is 30 days long, a DST day 23 or 25 h."""
    tz = ZoneInfo(zone)
    day = datetime.fromtimestamp(at, tz).replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if period == "day":
        start = day
    elif period == "week":
        start = day - timedelta(days=day.weekday())
    else:
        start = day.replace(day=1)
    return start.replace(tzinfo=tz).timestamp(), next_reset(period, zone, at)


def _policy(rule: Rule, now: float) -> tuple[_Policy, float]:
    """A rule's header parts that do not change with its state, and until when they hold (a
    calendar rule's: until its period ends)."""
    window, until = rule.policy_window, math.inf
    if rule.calendar_period is not None:  # `w` is the current period's length
        start, until = current_period(rule.calendar_period, rule.calendar, now)
        window = until - start
    policy = f'"{rule.name}";q={rule.quota_size}'
    if window > 0:
        policy += f";w={math.ceil(window)}"
    unit = _UNITS.get(float(rule.policy_window), b"") if str(rule.algorithm) in _WINDOWED else b""
    return _Policy(policy.encode(), f'"{rule.name}";r='.encode(), str(rule.quota_size).encode(), unit), until


class _Headed(NamedTuple):
    """What a rule set's headers say whatever the state, per rule (its `_Policy`), and the
    RateLimit-Policy value per rule named first; until the earliest calendar period ends."""

    rules: tuple[Rule, ...]  # held: the ids in the cache key cannot be reused while cached
    policies: tuple[_Policy, ...]
    enforced: tuple[int, ...]  # the rules that are not shadows
    firsts: dict[int, tuple[tuple[int, ...], bytes]]  # per rule named first: the order, the Policy value
    until: float


_HEADED: dict[tuple[int, ...], _Headed] = {}


def _headed(rules: Sequence[Rule]) -> _Headed:
    """A rule set's `_Headed`, cached by the rules' identities (the entry holds the rules, so their
    ids cannot be reused while cached)."""
    key = tuple(map(id, rules))
    found = _HEADED.get(key)
    if found is not None and (found.until == math.inf or time.time() < found.until):
        return found
    now = time.time()
    parts = [_policy(rule, now) for rule in rules]
    policies = tuple(policy for policy, _ in parts)
    until = min((until for _, until in parts), default=math.inf)
    if len(_HEADED) >= 4096:  # rule sets of configs reloaded away
        _HEADED.clear()
    found = _HEADED[key] = _Headed(tuple(rules), policies, tuple(i for i, r in enumerate(rules) if not r.shadow), {},
                                   until)
    return found


def ratelimit_headers(mode: str, rules: Sequence[Rule], decision: Decision) -> Headers:
    """The rate-limit headers of an answer: every enforced rule the request was counted by, the
    refusing or most restrictive one first. `draft`: the IETF fields, each a list with an item per
    rule; `legacy`: X-RateLimit-Limit/-Remaining/-Reset of the first, and Kong's per-window
    X-RateLimit-Limit-Minute and -Remaining-Minute (second, minute, hour, day) of each window rule."""
    if mode == "none":
        return []
    first = most_restrictive(rules, decision)
    if first is None:
        return []
    headed = _headed(rules)
    policies = headed.policies
    known = headed.firsts.get(first)
    if known is None:
        order = (first, *(i for i in headed.enforced if i != first))
        known = headed.firsts[first] = order, b", ".join(policies[i].policy for i in order)
    order = known[0]
    states = decision.rules
    headers: Headers = []
    if mode != "legacy":  # draft or both
        items = []
        for i in order:
            state = states[i]
            remaining = state.remaining if state.remaining > 0 else 0
            reset = state.reset_ms
            if reset >= 0:
                items.append(policies[i].name + b"%d;t=%d" % (remaining, -(-reset // 1000)))
            else:
                items.append(policies[i].name + b"%d" % remaining)
        headers.append((b"ratelimit-policy", known[1]))
        headers.append((b"ratelimit", b", ".join(items)))
    if mode != "draft":  # legacy or both
        state = states[first]
        headers.append((b"x-ratelimit-limit", policies[first].quota))
        headers.append((b"x-ratelimit-remaining", b"%d" % max(0, state.remaining)))
        if state.reset_ms >= 0:
            headers.append((b"x-ratelimit-reset", b"%d" % _seconds(state.reset_ms)))
        named: set[bytes] = set()
        for i in sorted(order, key=lambda i: (i != first, states[i].remaining)):  # the least left per unit
            policy = policies[i]
            if policy.unit and policy.unit not in named:
                named.add(policy.unit)
                headers.append((b"x-ratelimit-limit-" + policy.unit, policy.quota))
                headers.append((b"x-ratelimit-remaining-" + policy.unit, b"%d" % max(0, states[i].remaining)))
    return headers


def refusal(route: Route, rules: Sequence[Rule], decision: Decision) -> tuple[int, Headers, bytes]:
    index = decision.refused_by
    assert index is not None
    rule = rules[index]
    state = decision.rules[index]
    extra: dict[str, Any] = {"route": route.name, "rule": rule.name}
    if state.outcome is RuleOutcome.NEVER_FITS:
        detail = f"request cost exceeds what rule '{rule.name}' of route '{route.name}' can ever admit"
    else:
        detail = f"rate limit '{rule.name}' of route '{route.name}' exceeded"
    if decision.retry_after_ms is not None:
        extra["retry_after_ms"] = decision.retry_after_ms
    status, headers, body = problem(rule.status, detail, **extra)
    if decision.retry_after_ms is not None:
        headers.append((b"retry-after", str(_seconds(decision.retry_after_ms)).encode()))
    headers.extend(ratelimit_headers(route.headers, rules, decision))
    return status, headers, body
