"""What the client sees when the gateway answers itself: problem+json and rate-limit headers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from starlette.types import Send

from gateway.config import Route, Rule
from gateway.http.problem import PROBLEM, Headers, problem
from gateway.limiter import Decision, Outcome

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


_POLICIES: dict[int, tuple[Rule, tuple[bytes, bytes, bytes]]] = {}


def _policy(rule: Rule) -> tuple[bytes, bytes, bytes]:
    """What a rule's headers say whatever the state: the draft policy, its name, its quota.
    Cached by identity (the entry holds the rule, so its id cannot be reused while cached)."""
    entry = _POLICIES.get(id(rule))
    if entry is not None and entry[0] is rule:
        return entry[1]
    policy = f'"{rule.name}";q={rule.quota_size}'
    if rule.policy_window > 0:
        policy += f";w={math.ceil(rule.policy_window)}"
    parts = policy.encode(), f'"{rule.name}";r='.encode(), str(rule.quota_size).encode()
    if len(_POLICIES) >= 4096:  # rules of configs reloaded away
        _POLICIES.clear()
    _POLICIES[id(rule)] = (rule, parts)
    return parts


def ratelimit_headers(mode: str, rules: Sequence[Rule], decision: Decision) -> Headers:
    if mode == "none":
        return []
    index = most_restrictive(rules, decision)
    if index is None:
        return []
    state = decision.rules[index]
    policy, name, quota = _policy(rules[index])
    remaining = b"%d" % max(0, state.remaining)
    reset = b"%d" % _seconds(state.reset_ms) if state.reset_ms >= 0 else None
    headers: Headers = []
    if mode != "legacy":  # draft or both
        headers.append((b"ratelimit-policy", policy))
        headers.append((b"ratelimit", name + remaining + b";t=" + reset if reset is not None else name + remaining))
    if mode != "draft":  # legacy or both
        headers.append((b"x-ratelimit-limit", quota))
        headers.append((b"x-ratelimit-remaining", remaining))
        if reset is not None:
            headers.append((b"x-ratelimit-reset", reset))
    return headers


def refusal(route: Route, rules: Sequence[Rule], decision: Decision) -> tuple[int, Headers, bytes]:
    index = decision.refused_by
    assert index is not None
    rule = rules[index]
    state = decision.rules[index]
    extra: dict[str, Any] = {"route": route.name, "rule": rule.name}
    if state.outcome is Outcome.NEVER_FITS:
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
