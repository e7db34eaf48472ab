"""`respond: usage` (GitHub's GET /rate_limit): the caller's own usage of every rule it is counted by.

For each route the usage route reports (`usage_of`, default every route with limits), each rule whose
identity this request carries is looked up as that route would key it (its shard, its override for
this identity), and all of them are read in one script call that charges nothing (peek); on Redis
Cluster, one per hash tag the keys live under. A rule whose identity the request lacks (a path
parameter of another route, a header it did not send) is left out.
"""

from __future__ import annotations

import json
from collections import defaultdict

from gateway.errors import BadRequest, IdentityMissing, RedisUnavailable
from gateway.http.problem import Headers, problem
from gateway.identity import RequestView, rule_identity
from gateway.keys import rule_key
from gateway.limiter import RuleSpec
from gateway.outcome import Admit
from gateway.overrides import overridden
from gateway.runtime import Runtime

Reply = tuple[int, Headers, bytes]
MAX_PER_CALL = 32  # rules read by one script call (the bound of a route's own)


class _Read:
    __slots__ = ("key", "limit", "route", "rule", "spec")

    def __init__(self, route: str, rule: str, limit: int, spec: RuleSpec, key: str) -> None:
        self.route, self.rule, self.limit, self.spec, self.key = route, rule, limit, spec, key


def _reads(runtime: Runtime, admit: Admit) -> list[_Read]:
    view = RequestView(admit.request, {}, runtime.config, runtime.jwt)
    route = admit.plan.route
    names = route.usage_of or tuple(r.name for r in runtime.config.limited_routes if r.name != route.name)
    out: list[_Read] = []
    for name in names:
        plan = runtime.plans[name]
        table = runtime.overrides.get(name)
        shard = 0
        for i, rule in enumerate(plan.rules):
            try:
                parts = rule_identity(rule, view)
            except (IdentityMissing, BadRequest):
                parts = None
            if i == 0 and plan.shards > 1:
                if parts is None:
                    break  # no identity to pick the shard by: the route has nothing to say for this caller
                shard = plan.shard_of(parts)
            if parts is None:
                continue
            prefix = plan.shard_prefix_keys[shard][i]
            key = rule_key(prefix, parts, plan.readable[i])
            spec, limit = plan.shard_args[shard][i], rule.quota_size
            found = overridden(table, i, key[len(prefix):]) if table else None
            if found is not None:
                if found.rule is None:  # unlimited for this identity
                    continue
                spec, limit = found.specs[shard], found.rule.quota_size
            out.append(_Read(name, rule.name, limit, spec, key))
    return out


def _tag(key: str) -> str:
    return key[key.index("{") + 1:key.index("}")]


async def usage_answer(runtime: Runtime, admit: Admit) -> Reply:
    """The caller's usage as JSON (200), or a 503 problem when Redis does not answer."""
    reads = _reads(runtime, admit)
    groups: dict[str, list[_Read]] = defaultdict(list)
    cluster = runtime.redis.mode == "cluster"
    for read in reads:
        groups[_tag(read.key) if cluster else ""].append(read)
    rows: list[dict[str, object]] = []
    try:
        for group in groups.values():
            for at in range(0, len(group), MAX_PER_CALL):
                part = group[at:at + MAX_PER_CALL]
                decision = await runtime.limiter.decide([r.spec for r in part], [r.key for r in part],
                                                        [0] * len(part), peek=True)
                for read, state in zip(part, decision.rules, strict=True):
                    rows.append({"route": read.route, "rule": read.rule, "limit": read.limit,
                                 "remaining": max(0, state.remaining), "reset_ms": state.reset_ms})
    except RedisUnavailable:
        status, headers, body = problem(503, "usage is unavailable: Redis does not answer; try again shortly",
                                        route=admit.plan.route.name)
        headers.append((b"retry-after", b"1"))
        return status, headers, body
    order = {(r.route, r.rule): n for n, r in enumerate(reads)}
    rows.sort(key=lambda row: order[(str(row["route"]), str(row["rule"]))])
    body = json.dumps({"usage": rows}, separators=(",", ":")).encode()
    return 200, [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
                 (b"content-length", b"%d" % len(body))], body
