"""The admin port, a Starlette app: health, readiness, metrics, the rules in force, inspect/reset one
key, reload.

    GET    /healthz                          alive (200); the body says whether Redis answers a PING
                                             and this worker's breaker state
    GET    /readyz                           config loaded and serving (200); never asks Redis
    GET    /metrics                          Prometheus text
    GET    /limits                           every route and rule with its parameters (and shards, and
                                             whether each rule's limit is split over them)
    GET    /limits/{route}/{rule}?key=...    the state of one key; of a rule split over shards, the
                                             total over them and each shard's (docs/scaling.md)
    DELETE /limits/{route}/{rule}?key=...    reset it (in every shard)
    POST   /reload                           validate routes.yaml and swap it in
    GET    /overrides                        every rule's count of per-identity overrides, and a page
                                             of them all (?cursor=&limit=)
    GET    /overrides/{route}/{rule}         its overrides, paged (?cursor=&limit=); ?key=: one
    PUT    /overrides/{route}/{rule}?key=... replace the rule's parameters for one identity (JSON body
                                             of the rule's own parameters, or {"unlimited": true})
    DELETE /overrides/{route}/{rule}?key=... remove one (gateway/overrides.py)

Writes (DELETE, POST, PUT) need `Authorization: Bearer <admin.token>` when a token is configured (401
without it); with no token they are accepted from loopback peers only, naming a loopback Host, and
without an Origin other than the admin's own (403 otherwise: no CSRF from a page in the operator's
browser, no DNS rebinding).

The admin sees the gateway through `AdminControl` and Redis only through the `Limiter`
(`ping`, `reset`, `decide`): it never talks to a Redis connection itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import metrics, reload_log
from gateway.admin_common import (
    MAX_OVERRIDE_BODY,
    AdminControl,
    admin_body,
    is_cursor,
    problem_response,
    query_bytes,
    runtime_of,
    write_refusal,
)
from gateway.admin_consumers import consumer_routes
from gateway.admin_keys import key_routes
from gateway.api_keys import from_fingerprint
from gateway.config import BUCKET_ALGORITHMS, Rule, load_config
from gateway.console import console_routes
from gateway.errors import ConfigError, RedisUnavailable
from gateway.keying import keyed
from gateway.keys import identity_token, secret_part, shard_of
from gateway.limiter import Decision, Limiter, RuleOutcome, RuleSpec
from gateway.overrides import COMMAND, OverrideInvalid, Store, canonical, check_shards, parse_override
from gateway.overrides import SUFFIX as OVERRIDES_SUFFIX
from gateway.settings import supervised
from gateway.top import MAX_WINDOW
from gateway.units import parse_duration
from gateway.which_redis import needs_embedded_redis

if TYPE_CHECKING:
    from gateway.plan import RoutePlan
    from gateway.runtime import Runtime

A = TypeVar("A")
T = TypeVar("T")
# an identity token (gateway.keys.identity_token) that is not a value a client could have sent as
# is: the digest form; a readable token is its own key= value already
_TOKEN = re.compile(rb"^~[A-Za-z0-9_-]{20}$")
log = logging.getLogger("gateway.admin")
RELOAD_WAIT = 5.0  # seconds for the supervisor to pass a POST /reload on to this worker





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


def admin_app(control: AdminControl) -> Starlette:
    """The admin port's application; `control` is the gateway it reports on and acts for."""

    async def healthz(request: Request) -> Response:
        runtime = control.runtime
        if runtime is None:
            return JSONResponse({"status": "ok", "ready": False, "redis": None, "breaker": None})
        limiter = runtime.limiter
        started = time.perf_counter()
        redis: dict[str, Any]
        try:
            await limiter.ping()
        except RedisUnavailable as exc:
            redis = {"answers": False, "error": str(exc)[:300]}
        else:
            redis = {"answers": True, "latency_ms": round((time.perf_counter() - started) * 1000, 3)}
        return JSONResponse({
            "status": "ok",
            "ready": control.ready,
            "redis": redis,
            "breaker": limiter.breaker_state.name.lower(),
        })

    async def readyz(request: Request) -> Response:
        runtime = control.runtime
        if runtime is None or not control.ready:
            return problem_response(503, "configuration not loaded yet")
        return JSONResponse({"status": "ready", "routes": len(runtime.config.routes)})

    async def metrics_text(request: Request) -> Response:
        data, content_type = metrics.render()
        return Response(data, headers={"content-type": content_type})

    async def reload(request: Request) -> Response:
        refused = write_refusal(control, request)
        if refused is not None:
            return refused
        if supervised():
            try:
                ok, message = await _reload_every_worker(control)
            except TimeoutError:
                return problem_response(503, f"the supervisor did not pass the reload on within {RELOAD_WAIT:.0f}s")
        else:
            ok, message = control.reload()
        if not ok:
            return problem_response(422, "the new configuration is invalid; the old one stays in force",
                                    errors=message.splitlines())
        return JSONResponse({"reloaded": True, "detail": message})

    async def list_limits(request: Request) -> Response:
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
        runtime = runtime_of(control)
        named = _route_rule(runtime, request)
        if isinstance(named, Response):
            return named
        plan, index = named
        route_name, rule_name = plan.route.name, plan.rules[index].name
        if request.method == "DELETE":
            refused = write_refusal(control, request)
            if refused is not None:
                return refused
        rule = plan.rules[index]
        values = _key_values(request, rule)
        identity: str | None = None
        if _is_token(values, rule) and plan.shards == 1:
            token = values[0].decode()  # a key's digest, as the Redis key ends
        elif len(values) != len(rule.by):
            sources = ", ".join(str(s) for s in rule.by) or "none"
            return problem_response(400, f"give one key= per identity source of the rule ({sources}): the "
                                         "value, or a secret one's fingerprint kf_..., or the identity as "
                                         "the access log and /top show it")
        else:
            values = _as_counted(values, rule)
            token = identity_token(values, rule.readable_identity)
            identity = _shown(values, rule)
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
                deleted = await _each(keys, runtime.limiter.reset)
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

            states = await _each(list(zip(shards, keys, strict=True)), peek)
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

    async def list_overrides(request: Request) -> Response:
        runtime = runtime_of(control)
        store = Store(runtime.limiter, runtime.redis.key_prefix)
        rules = [(route, rule) for route in runtime.config.limited_routes for rule in route.limits]
        limit = _page_limit(request)
        at, _, cursor = request.query_params.get("cursor", "0.0").partition(".")
        if not (_whole(at) and len(at) < 8 and is_cursor(cursor)):
            return problem_response(400, "cursor: is the next_cursor of the page before", field="cursor")
        if limit is None:
            return problem_response(400, f"limit: is a whole number from 1 to {PAGE_LIMIT}", field="limit")
        index, listed = int(at), list[dict[str, Any]]()
        try:
            counts = await _each(rules, lambda rr: store.count(rr[0].name, rr[1].name))
            while index < len(rules) and len(listed) < limit:
                route, rule = rules[index]
                nxt, pairs = ("0", []) if not counts[index] else await store.page(
                    route.name, rule.name, cursor, limit - len(listed))
                shown = await Shown(runtime.limiter, store, route.name, rule.name).of([t for t, _ in pairs])
                listed += [{"route": route.name, "rule": rule.name, "key": key, "token": token,
                            "override": json.loads(text)} for (token, text), key in zip(pairs, shown, strict=True)]
                index, cursor = (index + 1, "0") if nxt == "0" else (index, nxt)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis is unavailable: {exc}")
        return JSONResponse({
            "rules": [{"route": route.name, "rule": rule.name, "algorithm": rule.algorithm, "overrides": count,
                       "max_overrides": rule.max_overrides}
                      for (route, rule), count in zip(rules, counts, strict=True)],
            "overrides": listed,
            "next_cursor": f"{index}.{cursor}" if index < len(rules) else None,
        })

    async def one_override(request: Request) -> Response:
        runtime = runtime_of(control)
        named = _route_rule(runtime, request)
        if isinstance(named, Response):
            return named
        plan, index = named
        route_name, rule_name = plan.route.name, plan.rules[index].name
        if request.method in ("PUT", "DELETE"):
            refused = write_refusal(control, request)
            if refused is not None:
                return refused
        rule = plan.rules[index]
        store = Store(runtime.limiter, runtime.redis.key_prefix)
        where: dict[str, Any] = {"route": route_name, "rule": rule_name}
        if request.method == "GET" and "key" not in request.query_params:
            return await _override_page(store, where, request)
        if request.method == "PUT" and rule.shared:  # kept per route, it would give one counter two limits
            return problem_response(409, f"rule {rule_name!r} is a shared rule, one counter for every route "
                                         "that uses it: its numbers are the file's for every identity", **where)
        given = _override_token(request, rule)
        if given is None:
            sources = ", ".join(str(s) for s in rule.by) or "none: give key= empty"
            return problem_response(400, f"give one key= per identity source of the rule ({sources}): the "
                                         "value, or a secret one's fingerprint kf_..., or the identity as "
                                         "the access log and /top show it")
        token, identity = given
        names = Shown(runtime.limiter, store, route_name, rule_name)
        try:
            if request.method == "GET":
                text = await store.get(route_name, rule_name, token)
                if text is None:
                    return problem_response(404, f"no override of {route_name}/{rule_name} for this key", **where)
                identity = (await names.of([token]))[0] if identity is None else identity
                return JSONResponse(where | {"key": identity, "token": token, "override": json.loads(text)})
            if request.method == "DELETE":
                if not await store.delete(route_name, rule_name, token):
                    return problem_response(404, f"no override of {route_name}/{rule_name} for this key", **where)
                await names.forget(token)
                return JSONResponse(where | {"key": identity or token, "token": token, "deleted": True})
            raw = await admin_body(request, MAX_OVERRIDE_BODY)
            if isinstance(raw, Response):
                return raw
            try:
                body = json.loads(raw)
                parsed = parse_override(rule, body)
                if parsed is not None:
                    check_shards(plan, index, parsed)
            except OverrideInvalid as exc:
                return problem_response(400, f"invalid override of {rule.algorithm} rule {rule_name!r}: {exc}",
                                        field=exc.field or None, **where)
            except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
                return problem_response(400, f"the body is not JSON: {str(exc)[:200]}", **where)
            if not await store.put(route_name, rule_name, token, canonical(body), rule.max_overrides):
                return problem_response(
                    409, f"rule {route_name}/{rule_name} holds its max_overrides ({rule.max_overrides}) "
                         "overrides already: delete some, or raise max_overrides in the file", **where)
            if identity:
                await names.remember(token, identity)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis is unavailable: {exc}")
        answer = where | {"key": identity or token, "token": token, "override": body, "applies_within_seconds": 2}
        settings = control.settings
        if needs_embedded_redis(settings, runtime.config) and settings.ephemeral:
            warning = ("the embedded Redis keeps this override in memory only (--ephemeral, or no state "
                       "directory: see the start-up log): it is gone when "
                       "the gateway stops (serve without --ephemeral keeps it, or set a Redis URL)")
            log.warning("override of %s/%s set: %s", route_name, rule_name, warning)
            answer |= {"survives_restart": False, "warning": warning}
        return JSONResponse(answer)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return problem_response(405, f"use {allowed or 'another method'} on {request.url.path[:200]}",
                                    headers=exc.headers)
        if exc.status_code == 404:
            return problem_response(404, f"no admin endpoint {request.url.path[:200]}")
        return problem_response(exc.status_code, str(exc.detail))

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics_text, methods=["GET"]),
            Route("/reload", reload, methods=["POST"]),
            Route("/limits", list_limits, methods=["GET"]),
            Route("/limits/{route}/{rule}", one_key, methods=["GET", "DELETE"]),
            Route("/top", top, methods=["GET"]),
            Route("/overrides", list_overrides, methods=["GET"]),
            Route("/overrides/{route}/{rule}", one_override, methods=["GET", "PUT", "DELETE"]),
            *key_routes(control),
            *consumer_routes(control),
            *console_routes(control),
        ],
        exception_handlers={HTTPException: http_error},
    )


SHARD_CALLS = 32  # admin calls in flight at once for a split rule's shards
PAGE_LIMIT = 1000  # overrides listed at most per page


def _key_values(request: Request, rule: Rule) -> list[bytes]:
    """`key=` as given, as bytes (%FF is 0xFF): one value per identity source, or one identity as
    the access log and /top show it (several parts joined by ':', split into its parts)."""
    values = query_bytes(request, "key")
    if len(values) == 1 and len(rule.by) > 1 and values[0].count(b":") == len(rule.by) - 1:
        return values[0].split(b":")
    return values


def _as_counted(values: list[bytes], rule: Rule) -> list[bytes]:
    """Each value as its rule counts it (gateway.keys.canonical_parts): a secret source's as its
    fingerprint (given as one, or as the value), a query parameter's as gateway/identity.py reads it."""
    out = []
    for value, source in zip(values, rule.by, strict=True):
        if source.kind == "query":
            value = value.decode("utf-8", "replace").encode().strip(b" \t")
        if source.secret and from_fingerprint(value.decode("latin-1")) is None:
            value = secret_part(value)
        out.append(value)
    return out


def _shown(values: list[bytes], rule: Rule) -> str | None:
    """The identity as logs and /top show it, from values `_as_counted` (None for a digest)."""
    if len(values) != len(rule.by):
        return None
    return ":".join(value.decode("utf-8", "backslashreplace") for value in values)


def _is_token(values: list[bytes], rule: Rule) -> bool:
    """Whether `key=` is an identity's digest, as a Redis key ends."""
    return len(values) == 1 and bool(rule.by) and _TOKEN.match(values[0]) is not None


def _override_token(request: Request, rule: Rule) -> tuple[str, str | None] | None:
    """The identity token `key=` names for `rule` (its values, one per source, or the identity as
    the access log and /top show it, or its digest), with the identity as shown; None if it names none."""
    values = _key_values(request, rule)
    if _is_token(values, rule):
        return values[0].decode(), None
    if not rule.by and values in ([], [b""]):
        return identity_token([], rule.readable_identity), ""
    if len(values) != len(rule.by):
        return None
    values = _as_counted(values, rule)
    return identity_token(values, rule.readable_identity), _shown(values, rule)


class Shown:
    """The identities a rule's overrides are shown as (gateway.keys.shown: a user id as it came, a
    secret as its fingerprint), kept beside them as the PUT named them: the override itself is
    keyed by a digest. An override written before this was kept shows its digest."""

    def __init__(self, limiter: Limiter, store: Store, route: str, rule: str) -> None:
        self.limiter = limiter
        self.key = store.hash_key(route, rule).removesuffix(OVERRIDES_SUFFIX) + "~shown"

    async def _command(self, *args: str) -> Any:
        return await self.limiter.run_script(COMMAND, [self.key], list(args))

    async def remember(self, token: str, identity: str) -> None:
        if identity != token:
            await self._command("HSET", token, identity)

    async def forget(self, token: str) -> None:
        await self._command("HDEL", token)

    async def of(self, tokens: list[str]) -> list[str]:
        if not tokens:
            return []
        found = await self._command("HMGET", *tokens)
        return [token if value is None else (value.decode() if isinstance(value, bytes) else str(value))
                for token, value in zip(tokens, found, strict=True)]


def _whole(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' (int() refuses it) and other scripts' digits."""
    return text.isascii() and text.isdigit()


def _page_limit(request: Request) -> int | None:
    """`?limit=` of a page of overrides (default 100), or None when it is not 1 to PAGE_LIMIT."""
    text = request.query_params.get("limit", "100")
    limit = int(text) if _whole(text) and len(text) < 8 else 0
    return limit if 0 < limit <= PAGE_LIMIT else None


async def _override_page(store: Store, where: dict[str, str], request: Request) -> Response:
    cursor = request.query_params.get("cursor", "0") or "0"
    limit = _page_limit(request)
    if not is_cursor(cursor):
        return problem_response(400, "cursor: is the next_cursor of the page before", field="cursor")
    if limit is None:
        return problem_response(400, f"limit: is a whole number from 1 to {PAGE_LIMIT}", field="limit")
    try:
        nxt, pairs = await store.page(where["route"], where["rule"], cursor, limit)
        count = await store.count(where["route"], where["rule"])
        shown = await Shown(store.limiter, store, where["route"], where["rule"]).of([t for t, _ in pairs])
    except RedisUnavailable as exc:
        return problem_response(503, f"Redis is unavailable: {exc}")
    return JSONResponse(where | {
        "count": count,
        "overrides": [{"key": key, "token": token, "override": json.loads(text)}
                      for (token, text), key in zip(pairs, shown, strict=True)],
        "next_cursor": None if nxt == "0" else nxt,
    })


async def _each(items: Sequence[A], call: Callable[[A], Awaitable[T]]) -> list[T]:
    """`call` for every item (one per shard), a few dozen at a time; the results in order."""
    out: list[T] = []
    for start in range(0, len(items), SHARD_CALLS):
        out.extend(await asyncio.gather(*(call(item) for item in items[start:start + SHARD_CALLS])))
    return out


def _route_rule(runtime: Runtime, request: Request) -> tuple[RoutePlan, int] | Response:
    """The route and the index of the rule a `/{route}/{rule}` path names, or its 404."""
    route_name, rule_name = request.path_params["route"], request.path_params["rule"]
    plan = runtime.plans.get(route_name)
    if plan is None:
        return problem_response(404, f"no route {route_name[:100]!r}")
    index = next((i for i, r in enumerate(plan.rules) if r.name == rule_name), None)
    if index is None:
        return problem_response(404, f"route {route_name!r} has no rule {rule_name[:100]!r}")
    return plan, index


async def _reload_every_worker(control: AdminControl) -> tuple[bool, str]:
    """Validate here, then let the supervisor signal every worker (this one included, so each
    reloads once) and answer with this worker's own outcome."""
    try:
        load_config(control.settings.config_path, decision_only=control.settings.decision_only)
    except ConfigError as exc:
        metrics.RELOADS.labels("error").inc()
        reload_log.note(False, str(exc))
        return False, str(exc)
    outcome = control.next_reload()
    os.kill(os.getppid(), signal.SIGHUP)
    return await asyncio.wait_for(outcome, RELOAD_WAIT)
