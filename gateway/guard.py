"""One request's verdict: identity -> limiter -> admit | refuse, shared by the proxy endpoint
(gateway/app.py) and the in-process middleware (gateway/middleware.py), so both decide alike.

`judge()` reads a rule's identities from the checked request, makes the ONE limiter call for the
route, applies the failure policy when Redis is unavailable, and returns a `Verdict`: either an
answer to send instead of the request, or the rate-limit headers (and leaky_bucket delay) of an
admitted one. It never sends anything itself.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import NamedTuple

from starlette.types import Receive

from gateway import metrics, proxy
from gateway.config import Route, Rule
from gateway.errors import BadRequest, IdentityMissing, RedisUnavailable
from gateway.identity import RequestView, rule_identity
from gateway.keys import rule_key
from gateway.limiter import Decision, Outcome, RuleSpec
from gateway.responses import Headers, problem, ratelimit_headers, refusal
from gateway.runtime import RoutePlan, Runtime

Answer = tuple[int, Headers, bytes]

MAX_COST_HEADER = 1_000_000_000


class Verdict(NamedTuple):
    outcome: str                 # admitted | failed_open | refused | refused_locally (from memory,
                                 # gateway/refusals.py) | failed_closed | bad_request | client_gone
    rule: str                    # the rule that refused or lacked an identity ("" otherwise)
    answer: Answer | None        # sent instead of forwarding; None: admitted
    headers: Headers             # rate-limit headers for an admitted request
    delay_ms: int                # leaky_bucket: hold the request this long before it goes on
    body_prefix: bytes | None    # body already read for a `body` identity (to be sent on first)
    more_body: bool              # whether more of the body is still to come from the client


async def judge(runtime: Runtime, plan: RoutePlan, view: RequestView, receive: Receive) -> Verdict:
    route = plan.route
    request = view.request
    more_body = request.has_body
    if plan.needs_body and more_body:
        try:
            view.body_prefix, more_body = await _read_prefix(receive, runtime.config.body_digest_max_bytes)
        except TimeoutError:
            answer = problem(408, "the request body stopped arriving", route=route.name)
            answer[1].append((b"connection", b"close"))
            return Verdict("bad_request", "", answer, [], 0, None, False)
        if view.body_prefix is None:
            return Verdict("client_gone", "", None, [], 0, None, False)
    elif plan.needs_body:
        view.body_prefix = b""

    try:
        rules, keys, costs, args = identify(plan, view)
    except IdentityMissing as exc:
        answer = problem(400, str(exc), route=route.name, rule=exc.rule)
        return Verdict("bad_request", exc.rule, answer, [], 0, view.body_prefix, more_body)
    except BadRequest as exc:
        answer = problem(exc.status, str(exc), route=route.name)
        return Verdict("bad_request", "", answer, [], 0, view.body_prefix, more_body)

    if not rules:
        return Verdict("admitted", "", None, [], 0, view.body_prefix, more_body)
    try:  # a refusal Redis gave and would give again is answered from memory (gateway/refusals.py)
        ask = partial(runtime.limiter.decide, args, keys, costs)
        decision, from_memory = await runtime.refusals.decide(rules, keys, costs, ask)
    except RedisUnavailable as exc:
        metrics.REDIS_ERRORS.labels(exc.kind).inc()
        if route.failure_mode == "closed":
            answer = problem(503, "rate limiting is unavailable; try again shortly", route=route.name)
            answer[1].append((b"retry-after", b"1"))
            return Verdict("failed_closed", "", answer, [], 0, view.body_prefix, more_body)
        return Verdict("failed_open", "", None, [], 0, view.body_prefix, more_body)
    if from_memory:
        assert decision.refused_by is not None
        name = rules[decision.refused_by].name
        metrics.rule_decisions(route.name, name, "refused_locally").inc()
        return Verdict("refused_locally", name, refusal(route, rules, decision), [], 0, view.body_prefix, more_body)
    _count_rules(route.name, rules, decision)
    if not decision.admitted:
        assert decision.refused_by is not None
        answer = refusal(route, rules, decision)
        return Verdict("refused", rules[decision.refused_by].name, answer, [], 0, view.body_prefix, more_body)
    headers = ratelimit_headers(route.headers, rules, decision)
    return Verdict("admitted", "", None, headers, decision.delay_ms, view.body_prefix, more_body)


class Identified(NamedTuple):
    rules: list[Rule]             # the rules this request has identities for
    keys: list[str]               # one per rule of the route ...
    costs: list[int | None]       # ... None where the rule sits out (on_missing: skip)
    args: tuple[RuleSpec, ...]    # the specs of the request's shard


def identify(plan: RoutePlan, view: RequestView) -> Identified:
    """The request's rules, keys and costs. Raises IdentityMissing or BadRequest."""
    rules: list[Rule] = []
    keys: list[str] = []
    costs: list[int | None] = []
    args, prefix_keys = plan.args, plan.prefix_keys
    for i, rule in enumerate(plan.rules):
        parts = rule_identity(rule, view)
        if i == 0 and plan.shards > 1:  # the first rule's identity picks the shard (gateway.keys)
            shard = plan.shard_of(parts)
            args, prefix_keys = plan.shard_args[shard], plan.shard_prefix_keys[shard]
        if parts is None:
            keys.append(prefix_keys[i])
            costs.append(None)
            continue
        rules.append(rule)
        keys.append(rule_key(prefix_keys[i], parts))
        costs.append(_cost(rule, view))
    return Identified(rules, keys, costs, args)


def held_refusal(runtime: Runtime, plan: RoutePlan, view: RequestView) -> tuple[Identified, Decision] | None:
    """The refusal held in memory for this request (gateway/refusals.py), with what was read from
    the request; None when the full path must decide. Synchronous: the server protocol calls it
    before the application is entered, so a flood's refusals cost no task, no Starlette layer and
    no ASGI message."""
    if plan.needs_body or not runtime.refusals.enabled or not plan.rules:
        return None
    try:
        identified = identify(plan, view)
    except (IdentityMissing, BadRequest):
        return None
    decision = held_decision(runtime, plan.route, identified.rules, identified.keys, identified.costs)
    return None if decision is None else (identified, decision)


def held_decision(runtime: Runtime, route: Route, rules: list[Rule], keys: list[str],
                  costs: list[int | None]) -> Decision | None:
    """The refusal held for these keys and costs (of `route`'s rules, `rules` taking part), counted
    as refused locally; None if none holds."""
    decision = runtime.refusals.answer(keys, costs) if rules else None
    if decision is None or decision.refused_by is None:
        return None
    metrics.rule_decisions(route.name, rules[decision.refused_by].name, "refused_locally").inc()
    return decision


def _count_rules(route: str, rules: list[Rule], decision: Decision) -> None:
    for rule, state in zip(rules, decision.rules, strict=True):
        if state.outcome is Outcome.SHADOW_REFUSES:
            metrics.rule_decisions(route, rule.name, "shadow_refused").inc()
        elif state.outcome is not Outcome.ADMITS:
            metrics.rule_decisions(route, rule.name, "refused").inc()
        elif decision.admitted:
            metrics.rule_decisions(route, rule.name, "admitted").inc()


async def _read_prefix(receive: Receive, limit: int) -> tuple[bytes | None, bool]:
    """Read up to `limit` bytes of the body (whole messages); None if the client went away.
    Raises TimeoutError when the body pauses longer than the body timeout."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more and size < limit:
        message = await asyncio.wait_for(receive(), proxy.BODY_CHUNK_TIMEOUT)
        if message["type"] == "http.disconnect":
            return None, False
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), more


def _cost(rule: Rule, view: RequestView) -> int:
    header = rule.cost_header
    if header is None:
        return rule.cost
    raw = view.header(header.lower().encode())
    if raw is None:
        return rule.cost
    text = raw.strip()
    if not text.isdigit() or len(text) > 10 or not 0 < int(text) <= MAX_COST_HEADER:
        raise BadRequest(f"header {header} must be a whole number from 1 to {MAX_COST_HEADER}")
    return int(text)
