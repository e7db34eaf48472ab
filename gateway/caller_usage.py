"""`respond: usage` (GitHub's GET /rate_limit): the caller's own usage of every rule it is counted by.

The routes reported (`usage_of`, default every HTTP route with limits) are those this caller could
match: its plan, headers, verified claims and address meet the route's `match` conditions, and no
earlier route it meets takes every request of the route's path first (a pro caller never reaches the
free route of the same path). An RLS domain is not reported: its rules are keyed by the descriptors
Envoy sends, which no HTTP request carries. For each route reported, each rule whose identity this
request carries is looked up as that route would key it (its shard, its override for this identity);
a shared rule (`{use: NAME}`), one counter wherever used, is one row naming every such route. All are
read in one script call that charges nothing (peek); on Redis Cluster, one per hash tag the keys live
under. A rule whose identity the request lacks (a path parameter of another route, a header it did
not send) is left out. A rule keyed by `method` is read once per method its route takes, each row
naming its method (the usage request's own GET is not what the route counts).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence

from gateway.config import PARAM, Route, Rule
from gateway.errors import BadRequest, IdentityMissing, RedisUnavailable
from gateway.http.problem import Headers, problem
from gateway.identity import RequestView, rule_identity
from gateway.keying import keyed, token_of
from gateway.limiter import RuleSpec
from gateway.match import compile_template
from gateway.outcome import Admit
from gateway.runtime import Runtime

Reply = tuple[int, Headers, bytes]
MAX_PER_CALL = 32  # rules read by one script call (the bound of a route's own)


class _Read:
    __slots__ = ("key", "limit", "method", "route", "routes", "rule", "spec")

    def __init__(self, route: str, rule: str, limit: int, spec: RuleSpec, key: str, shared: bool,
                 method: str | None) -> None:
        self.route, self.rule, self.limit, self.spec, self.key = route, rule, limit, spec, key
        self.routes = [route] if shared else None  # a shared rule: every reported route counting by it
        self.method = method  # a rule keyed by `method`: the one of the route's methods this row counts


def _by_method(rule: Rule) -> bool:
    return any(source.kind == "method" for source in rule.by)


def _methods(route: Route, rules: tuple[Rule, ...]) -> Sequence[str | None]:
    """The methods to read the route's rules under: each method the route takes when a rule keys by
    the method (a route taking any method has no one counter to show: such rules are left out)."""
    if route.methods is None or not any(_by_method(rule) for rule in rules):
        return [None]
    return sorted(route.methods)


def _view(runtime: Runtime, admit: Admit) -> RequestView:
    """The request as `match` conditions read it, with its API key's plan (as gateway/pipeline.py sets it)."""
    view = RequestView(admit.request, {}, runtime.config, runtime.jwt)
    settings, table = runtime.config.keys, runtime.keys
    if settings is not None:
        try:
            key = view.read(settings.source)
        except BadRequest:
            key = None
        found = table.lookup(key) if key and table is not None else None
        view.plan, view.consumer = found or ("none", None)
    return view


def _takes_all_of(earlier: Route, route: Route) -> bool:
    """Whether `earlier`, tried first, leaves `route` no request when its own conditions hold: any
    path of `route` matches its template, under every host of `route`, and it takes the methods of
    `route` (or `route` names none, and `earlier`, naming some, owns the path: gateway/match.py)."""
    if earlier.host is not None and earlier.host != route.host:
        return False
    if earlier.methods is not None and route.methods is not None and not route.methods <= earlier.methods:
        return False  # (a route without methods never takes the others: the earlier one owns the path)
    if earlier.path_case != route.path_case and earlier.path_case != "insensitive":
        return False
    if PARAM.search(route.path) is not None:
        return earlier.path == route.path
    return compile_template(earlier.path, earlier.path_case == "insensitive").match(route.path) is not None


def _could_match(view: RequestView, route: Route, routes: tuple[Route, ...]) -> bool:
    """Whether this caller could have a request taken by `route`, as gateway/match.py tries routes."""
    try:
        if route.when and not view.meets(route):
            return False
        for earlier in routes:
            if earlier is route:
                return True
            if _takes_all_of(earlier, route) and (not earlier.when or view.meets(earlier)):
                return False
    except BadRequest:  # a header a condition reads came twice: such a request matches nothing
        return False
    return True


def _reported(runtime: Runtime, admit: Admit, view: RequestView) -> list[str]:
    routes = runtime.config.routes
    own = admit.plan.route
    names = own.usage_of or tuple(r.name for r in routes if r.limits and r.name != own.name)
    by_name = {r.name: r for r in routes}
    return [name for name in names if _could_match(view, by_name[name], routes)]


def _reads(runtime: Runtime, admit: Admit) -> list[_Read]:
    view = _view(runtime, admit)
    out: list[_Read] = []
    seen: dict[str, _Read] = {}  # by key: a shared rule is one counter, one row
    for name in _reported(runtime, admit, view):
        plan = runtime.plans[name]
        table = runtime.overrides.get(name)
        for method in _methods(plan.route, plan.rules):
            view.method = method  # this usage request's own method is none of the route's
            shard = 0
            for i, rule in enumerate(plan.rules):
                keyed_by_method = _by_method(rule)
                try:
                    parts = None if keyed_by_method and method is None else rule_identity(rule, view)
                except (IdentityMissing, BadRequest):
                    parts = None
                if i == 0 and plan.shards > 1:
                    if parts is None:
                        break  # no identity to pick the shard by: nothing to say for this caller
                    shard = plan.shard_of(parts)
                if parts is None:
                    continue
                found = keyed(plan, i, token_of(plan, i, parts), shard, table)
                if found.unlimited:  # for this identity
                    continue
                key = found.key
                if key in seen:
                    routes = seen[key].routes
                    if routes is not None and name not in routes:
                        routes.append(name)
                    continue
                seen[key] = _Read(name, rule.name, found.rule.quota_size, found.spec, key, rule.shared,
                                  method if keyed_by_method else None)
                out.append(seen[key])
    view.method = None
    return out


def _tag(key: str) -> str:
    return key[key.index("{") + 1:key.index("}")]


async def usage_answer(runtime: Runtime, admit: Admit) -> Reply:
    """The caller's usage as JSON (200), or a 503 problem when Redis does not answer."""
    reads = _reads(runtime, admit)
    groups: dict[str, list[int]] = defaultdict(list)  # places in `reads`, by the hash tag of their keys
    cluster = runtime.redis.mode == "cluster"
    for n, read in enumerate(reads):
        groups[_tag(read.key) if cluster else ""].append(n)
    rows: dict[int, dict[str, object]] = {}  # by the read's place: the answer keeps the reads' order
    try:
        for group in groups.values():
            for at in range(0, len(group), MAX_PER_CALL):
                part = group[at:at + MAX_PER_CALL]
                decision = await runtime.limiter.decide([reads[n].spec for n in part], [reads[n].key for n in part],
                                                        [0] * len(part), peek=True)
                for n, state in zip(part, decision.rules, strict=True):
                    read = reads[n]
                    row: dict[str, object] = {"route": read.route, "rule": read.rule, "limit": read.limit,
                                              "remaining": max(0, state.remaining), "reset_ms": state.reset_ms}
                    if read.method is not None:
                        row["method"] = read.method
                    if read.routes is not None:
                        row["routes"] = read.routes
                    rows[n] = row
    except RedisUnavailable:
        status, headers, body = problem(503, "usage is unavailable: Redis does not answer; try again shortly",
                                        route=admit.plan.route.name)
        headers.append((b"retry-after", b"1"))
        return status, headers, body
    named = {"consumer": admit.consumer or None} if runtime.config.keys is not None else {}
    body = json.dumps(named | {"usage": [rows[n] for n in sorted(rows)]}, separators=(",", ":")).encode()
    return 200, [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
                 (b"content-length", b"%d" % len(body))], body
