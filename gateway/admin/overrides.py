"""Per-identity overrides on the admin port (gateway/overrides.py).

    GET    /overrides                        every rule's count of per-identity overrides, and a page
                                             of them all (?cursor=&limit=)
    GET    /overrides/{route}/{rule}         its overrides, paged (?cursor=&limit=); ?key=: one
    PUT    /overrides/{route}/{rule}?key=... replace the rule's parameters for one identity (JSON body
                                             of the rule's own parameters, or {"unlimited": true})
    DELETE /overrides/{route}/{rule}?key=... remove one
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin.common import (
    MAX_OVERRIDE_BODY,
    admin_body,
    control_of,
    each,
    is_cursor,
    json_text,
    problem_response,
    route_rule,
    runtime_of,
    write_refusal,
)
from gateway.admin.identities import as_counted, is_token, key_values, shown_identity
from gateway.config import Rule
from gateway.errors import RedisUnavailable
from gateway.keys import identity_token
from gateway.limiter import Limiter
from gateway.overrides import COMMAND, OverrideInvalid, Store, canonical, check_shards, parse_override
from gateway.overrides import SUFFIX as OVERRIDES_SUFFIX
from gateway.which_redis import needs_embedded_redis

log = logging.getLogger("gateway.admin")


PAGE_LIMIT = 1000  # overrides listed at most per page


async def list_overrides(request: Request) -> Response:
    control = control_of(request)
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
        counts = await each(rules, lambda rr: store.count(rr[0].name, rr[1].name))
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
    control = control_of(request)
    runtime = runtime_of(control)
    named = route_rule(runtime, request)
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
            body = json_text(raw)
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


def _override_token(request: Request, rule: Rule) -> tuple[str, str | None] | None:
    """The identity token `key=` names for `rule` (its values, one per source, or the identity as
    the access log and /top show it, or its digest), with the identity as shown; None if it names none."""
    values = key_values(request, rule)
    if is_token(values, rule):
        return values[0].decode(), None
    if not rule.by and values in ([], [b""]):
        return identity_token([], rule.readable_identity), ""
    if len(values) != len(rule.by):
        return None
    values = as_counted(values, rule)
    return identity_token(values, rule.readable_identity), shown_identity(values, rule)


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
