"""One decision, whichever door asked (proxy, middleware, check endpoint, RLS): a refusal held in
memory (gateway/refusals.py) when Redis would give it again, else the limiter's one script call;
Redis's failures counted once, and every rule's part in the outcome counted the same way whether
Redis or memory decided.

The doors differ only in how they read a request into rules, keys and costs, and in how they
answer; what happens between is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from gateway import metrics
from gateway.config import Rule
from gateway.errors import RedisUnavailable
from gateway.limiter import Decision, RuleOutcome, RuleSpec
from gateway.runtime import Runtime


async def decide(runtime: Runtime, route: str, rules: list[Rule], keys: list[str], costs: list[int | None],
                 specs: Sequence[RuleSpec], lease: bytes = b"",
                 any_kinds: tuple[str, ...] | None = None) -> tuple[Decision, bool]:
    """The decision for these rules, keys and costs, and whether memory gave it (True) or Redis.
    `any_kinds`: the calendar zones of the one script that takes rules of any kind (the RLS port's
    calls of several rules). Raises RedisUnavailable, counted in gateway_redis_errors_total."""
    refusals = runtime.refusals
    try:
        if refusals.quiet():  # nothing held: straight to Redis, no probe to wait on
            sent = refusals.clock()
            decision = await runtime.limiter.decide(specs, keys, costs, lease=lease, any_kinds=any_kinds)
            refusals.answered(rules, keys, costs, decision, sent)
            from_memory = False
        else:
            decision, from_memory = await refusals.decide(rules, keys, costs, partial(
                runtime.limiter.decide, specs, keys, costs, lease=lease, any_kinds=any_kinds))
    except RedisUnavailable as exc:
        metrics.REDIS_ERRORS.labels(exc.kind).inc()
        raise
    if from_memory:
        count_held(route, rules, decision)
    else:
        count_rules(route, rules, decision)
    return decision, from_memory


def count_held(route: str, rules: list[Rule], decision: Decision) -> None:
    """A refusal answered from memory: its refusing rule, the one rule memory knows the state of."""
    assert decision.refused_by is not None
    metrics.rule_decisions(route, rules[decision.refused_by].name, "refused", "memory").inc()


def count_rules(route: str, rules: list[Rule], decision: Decision) -> None:
    for rule, state in zip(rules, decision.rules, strict=True):
        if state.outcome is RuleOutcome.SHADOW_REFUSES:
            metrics.rule_decisions(route, rule.name, "shadow_refused", "redis").inc()
        elif state.outcome is not RuleOutcome.ADMITS:
            metrics.rule_decisions(route, rule.name, "refused", "redis").inc()
        elif decision.admitted:
            metrics.rule_decisions(route, rule.name, "admitted", "redis").inc()
