"""The rules in force, one key's state and its reset, and the identities refused most.

    GET    /limits                          every route and rule with its parameters (and shards, and
                                            whether each rule's limit is split over them)
    GET    /limits/{route}/{rule}?key=...   the state of one key; of a rule split over shards, the
                                            total over them and each shard's (docs/scaling.md)
    DELETE /limits/{route}/{rule}?key=...   reset it (in every shard)
    GET    /top                             the identities refused most (?window=&route=&limit=)
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin.common import (
    control_of,
    each,
    problem_response,
    route_rule,
    runtime_of,
    write_refusal,
)
from gateway.admin.identities import as_counted, is_token, key_values, shown_identity
from gateway.config import BUCKET_ALGORITHMS, Rule
from gateway.errors import RedisUnavailable
from gateway.keying import keyed
from gateway.keys import identity_token, shard_of
from gateway.limiter import Decision, RuleOutcome, RuleSpec
from gateway.top import MAX_WINDOW
from gateway.units import parse_duration


def rule_parameters(rule: Rule) -> dict[str, Any]:
    out: dict[str, Any] = {"name": rule.name, "algorithm": rule.algorithm, "by": [str(s) for s in rule.by]}
    if rule.shared:
        out["shared"] = True
    if rule.algorithm in BUCKET_ALGORITHMS:
        out["rate_per_second"] = rule.rate
        out["burst"] = rule.burst
    elif rule.algorithm == "concurrency":
        out["limit"] = rule.limit
        out["lease_seconds"] = rule.lease
    else:
        out["limit"] = rule.limit
        key = "period_seconds" if rule.algorithm == "quota" else "window_seconds"
        if rule.calendar_period is not None:  # a day, week or month of a time zone (gateway/calendars.py)
            out[key.removesuffix("_seconds")], out["calendar"] = rule.calendar_period, rule.calendar
        elif rule.window or rule.algorithm != "quota":
            out[key] = rule.window
    out["cost"] = f"header:{rule.cost_header}" if rule.cost_header else rule.cost
    if rule.cost_header:
        out["cost_default"] = rule.cost
    if rule.cost_response_header:
        out["cost"] = f"response_header:{rule.cost_response_header}"
    if rule.settle_field:  # a token budget
        out["cost"] = {"reserve": "request_json:" + ".".join(rule.reserve_field) if rule.reserve_field else rule.cost,
                       "default": rule.cost, "settle": "response_json:" + ".".join(rule.settle_field)}
    for name in ("count_on", "refund_on"):
        if getattr(rule, name):
            out[name] = _statuses(getattr(rule, name))
    out.update(status=rule.status, shadow=rule.shadow, on_missing=rule.on_missing)
    return out


def _statuses(codes: frozenset[int]) -> list[int | str]:
    """Statuses as the file writes them: a whole class as `5xx`, others one by one."""
    out: list[int | str] = []
    for first in range(100, 600, 100):
        covered = sorted(code for code in codes if first <= code < first + 100)
        out += [f"{first // 100}xx"] if len(covered) == 100 else covered
    return out


async def list_limits(request: Request) -> Response:
    control = control_of(request)
    runtime = runtime_of(control)
    routes = []
    domains = {domain.route.name: domain.name for domain in runtime.config.rls}
    for route in runtime.config.limited_routes:
        routes.append({
            "name": route.name,
            "match": {"path": route.path, "methods": sorted(route.methods) if route.methods else None,
                      "host": route.host} if route.name not in domains else {"rls_domain": domains[route.name]},
            "upstream": route.upstream.name if route.upstream else None,
            "failure_mode": route.failure_mode,
            "headers": route.headers,
            "shards": route.shards,
            "rules": [rule_parameters(rule) | ({"split": split} if route.shards > 1 else {})
                      for rule, split in zip(route.limits, route.split, strict=True)],
        })
    return JSONResponse({"routes": routes})


async def one_key(request: Request) -> Response:
    control = control_of(request)
    runtime = runtime_of(control)
    named = route_rule(runtime, request)
    if isinstance(named, Response):
        return named
    plan, index = named
    route_name, rule_name = plan.route.name, plan.rules[index].name
    if request.method == "DELETE":
        refused = write_refusal(control, request)
        if refused is not None:
            return refused
    rule = plan.rules[index]
    values = key_values(request, rule)
    identity: str | None = None
    if is_token(values, rule) and plan.shards == 1:
        token = values[0].decode()  # a key's digest, as the Redis key ends
    elif len(values) != len(rule.by):
        sources = ", ".join(str(s) for s in rule.by) or "none"
        return problem_response(400, f"give one key= per identity source of the rule ({sources}): the "
                                     "value, or a secret one's fingerprint kf_..., or the identity as "
                                     "the access log and /top show it")
    else:
        values = as_counted(values, rule)
        token = identity_token(values, rule.readable_identity)
        identity = shown_identity(values, rule)
    split = plan.route.split[index]
    if split:  # a share of the rule in every shard
        shards = list(range(plan.shards))
    else:  # one shard: the one the first rule's identity, read from this key's, picks
        first = plan.rules[0].by
        shards = [shard_of([values[rule.by.index(s)] for s in first], plan.shards)] if plan.shards > 1 else [0]
    # per shard, as this worker keys and overrides this identity (gateway/keying.py)
    table = runtime.overrides.get(route_name)
    found = {shard: keyed(plan, index, token, shard, table) for shard in shards}
    keys = [found[shard].key for shard in shards]
    override = found[shards[0]].override

    def spec_of(shard: int) -> RuleSpec:
        return found[shard].spec

    try:
        if request.method == "DELETE":
            deleted = await each(keys, runtime.limiter.reset)
            for key in keys:  # this worker's memory; others hold theirs until the retry
                runtime.refusals.forget_key(key)
            body: dict[str, Any] = {"route": route_name, "rule": rule_name, "key": keys[0],
                                    "identity": identity, "reset": any(deleted)}
            if split:
                body.update(key=None, keys=len(keys), reset_shards=sum(deleted))
            return JSONResponse(body)
        limiter = runtime.limiter

        def peek(at: tuple[int, str]) -> Awaitable[Decision]:
            return limiter.decide([spec_of(at[0])], [at[1]], [0], peek=True)

        states = await each(list(zip(shards, keys, strict=True)), peek)
    except RedisUnavailable as exc:
        return problem_response(503, f"Redis is unavailable: {exc}")
    read = [decision.rules[0] for decision in states]
    spent = [state.outcome is not RuleOutcome.ADMITS or state.remaining <= 0 for state in read]
    per_shard = [{
        "shard": shard,
        "key": key,
        "limit": spec_of(shard).p1,
        "remaining": state.remaining,
        "reset_ms": state.reset_ms,
        "exhausted": exhausted,
    } for shard, key, state, exhausted in zip(shards, keys, read, spent, strict=True)]
    resets = [state.reset_ms for state in read]
    out: dict[str, Any] = {
        "route": route_name,
        "rule": rule_name,
        "algorithm": rule.algorithm,
        "key": keys[0],
        "identity": identity,
        "limit": override.rule.quota_size if override and override.rule else rule.quota_size,
        "remaining": sum(state.remaining for state in read),
        "reset_ms": -1 if min(resets) < 0 else max(resets),
        "exhausted": all(spent),
    }
    if override is not None:
        out["override"] = "unlimited" if override.rule is None else "numbers"
    if plan.shards > 1:
        out["shards"] = plan.shards
        out["split"] = split
        if split:
            out["key"] = None
            out["per_shard"] = per_shard
        else:
            out["shard"] = shards[0]
    return JSONResponse(out)


async def top(request: Request) -> Response:
    control = control_of(request)
    route = request.query_params.get("route") or None
    try:
        window = parse_duration(request.query_params.get("window", "5m"))
        limit = int(request.query_params.get("limit", "20"))
    except ValueError as exc:
        return problem_response(400, f"window is a duration (5m, 1h) and limit a whole number: {exc}")
    if not 0 < window <= MAX_WINDOW or not 0 < limit <= 1000:
        return problem_response(400, f"window may be up to {MAX_WINDOW // 60} minutes and limit up to 1000")
    if route is not None and route not in runtime_of(control).plans:
        return problem_response(404, f"no route named {route[:200]!r}")
    found = control.top.top(window, route, limit)
    return JSONResponse({"route": route, "window_seconds": window, "top": [{
        "route": r.route, "rule": r.rule, "identity": r.identity, "consumer": r.consumer or None,
        "refusals": r.refusals,
        "error": r.error} for r in found]})
