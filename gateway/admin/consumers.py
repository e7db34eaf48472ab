"""The admin port's /consumers/{name}: one consumer's API keys and its usage (gateway/api_keys.py).

A consumer is named when its keys are registered (`PUT /keys` with `"consumer": NAME`); a key
registered without one is a consumer of its own, named by the key's fingerprint. The answer lists
its keys (fingerprints, plans, metadata) and, for every rule counted `by: [consumer]`, its state as
`/limits/{route}/{rule}?key=NAME` shows it: limit, remaining, reset. It reads, never charges. A
name no registered key belongs to is a 404.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.common import AdminControl, problem_response, runtime_of
from gateway.admin.keys import CONSUMER, shown_entry
from gateway.api_keys import KeyEntry, KeyStore, from_fingerprint
from gateway.config import Source
from gateway.errors import RedisUnavailable
from gateway.keys import rule_key
from gateway.limiter import RuleSpec
from gateway.overrides import overridden
from gateway.runtime import Runtime

MAX_LISTED = 1000  # keys of one consumer listed


def _by_consumer(rule_by: tuple[Source, ...]) -> bool:
    return len(rule_by) == 1 and rule_by[0].kind == "consumer"


def _counted(runtime: Runtime, name: str) -> list[tuple[list[str], str, int, RuleSpec | None, str]]:
    """Every rule counted by the consumer alone: (routes, rule, limit, spec or None when this
    consumer's override makes it unlimited, key). A shared rule is one counter: one entry naming
    each route using it. A rule of a sharded route is read where the route keeps it for this consumer
    (its first rule counts by consumer too, and the rule is not split); otherwise it is left out."""
    out: dict[str, tuple[list[str], str, int, RuleSpec | None, str]] = {}
    parts = [name.encode()]
    for route_name, plan in runtime.plans.items():
        for i, rule in enumerate(plan.rules):
            if not _by_consumer(rule.by):
                continue
            shard = 0
            if plan.shards > 1:
                if plan.route.split[i] or not _by_consumer(plan.rules[0].by):
                    continue
                shard = plan.shard_of(parts)
            prefix = plan.shard_prefix_keys[shard][i]
            key = rule_key(prefix, parts, plan.readable[i])
            if key in out:
                out[key][0].append(route_name)
                continue
            spec: RuleSpec | None = plan.shard_args[shard][i]
            limit = rule.quota_size
            found = overridden(runtime.overrides.get(route_name), i, key[len(prefix):])
            if found is not None:
                spec = None if found.rule is None else found.specs[shard]
                limit = 0 if found.rule is None else found.rule.quota_size
            out[key] = ([route_name], rule.name, limit, spec, key)
    return list(out.values())


async def _keys_of(store: KeyStore, name: str) -> list[tuple[int, KeyEntry]]:
    own = from_fingerprint(name)
    if own is not None:  # a key's own consumer: that key, if it names no other
        entry = await store.entry(own)
        return [(own, entry)] if entry is not None and entry.consumer == name else []
    values = await store.consumer_keys(name, MAX_LISTED)
    entries = await store.entries(values)
    return [(value, entry) for value, entry in zip(values, entries, strict=True) if entry is not None]


def consumer_routes(control: AdminControl) -> list[Route]:
    async def one(request: Request) -> Response:
        runtime = runtime_of(control)
        if runtime.config.keys is None:
            return problem_response(404, "this configuration has no keys: section")
        name = request.path_params["name"]
        if not CONSUMER.match(name) and from_fingerprint(name) is None:
            return problem_response(404, f"no consumer {name[:100]!r}: a consumer's name is 1 to 64 letters, "
                                         "digits and . _ @ -, or a key's fingerprint kf_...")
        store = KeyStore(runtime.limiter, runtime.redis.key_prefix)
        try:
            keys = await _keys_of(store, name)
            if not keys:
                return problem_response(404, f"no consumer {name!r}: no registered key belongs to it",
                                        consumer=name)
            usage = []
            for routes, rule, limit, spec, key in _counted(runtime, name):
                row: dict[str, Any] = {"route": routes[0], "rule": rule}
                if len(routes) > 1:
                    row["routes"] = routes
                if spec is None:
                    usage.append(row | {"override": "unlimited"})
                    continue
                state = (await runtime.limiter.decide([spec], [key], [0], peek=True)).rules[0]
                usage.append(row | {"limit": limit, "remaining": max(0, state.remaining),
                                    "reset_ms": state.reset_ms})
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis unavailable: {exc}")
        return JSONResponse({"consumer": name, "keys": [shown_entry(value, entry) for value, entry in keys],
                             "usage": usage})

    return [Route("/consumers/{name}", one, methods=["GET"])]
