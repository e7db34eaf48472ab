"""The admin port's /keys: API keys and their plans (gateway/api_keys.py).

    PUT    /keys?key=K          {"plan": "pro"}: register K (or move it to another plan)
    GET    /keys?key=K          its plan (K, or its fingerprint kf_...)
    DELETE /keys?key=K          remove it
    GET    /keys?plan=pro       the plan's keys, fingerprints only, a page at a time (?cursor=&limit=)
    POST   /keys                {"keys": [{"key": K, "plan": P}, ...]}: many at once, all or none

A write with a plan not in `keys.plans`, an empty or oversized key, or a bulk body past its bound is
a 400 naming the problem, and changes nothing. Writes need the admin token as every admin write.
Every gateway applies a change within about a second (the change signal, gateway/overrides.py).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin_common import (
    ADMIN_BODY_TIMEOUT,
    AdminControl,
    TooLarge,
    bounded_body,
    problem_response,
    runtime_of,
    write_refusal,
)
from gateway.api_keys import MAX_BULK, MAX_KEY_BYTES, KeyStore, digest, fingerprint, from_fingerprint
from gateway.config import KeysSettings
from gateway.errors import RedisUnavailable
from gateway.overrides import Store

MAX_BULK_BODY = 2 * 1024 * 1024  # bytes of a POST /keys
PAGE_LIMIT = 1000


class _Invalid(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _key_digest(text: str, may_be_fingerprint: bool = True) -> int:
    if may_be_fingerprint and (value := from_fingerprint(text)) is not None:
        return value
    raw = text.encode("utf-8", "surrogateescape")
    if not raw.strip():
        raise _Invalid("key", "is empty")
    if len(raw) > MAX_KEY_BYTES:
        raise _Invalid("key", f"is longer than {MAX_KEY_BYTES} bytes")
    return digest(raw.strip(b" \t"))  # as the identity source reads it: surrounding whitespace trimmed


def _plan(settings: KeysSettings, value: Any) -> str:
    if not isinstance(value, str) or value not in settings.plans:
        raise _Invalid("plan", f"must be one of {', '.join(settings.plans)} (keys.plans)")
    return value


def key_routes(control: AdminControl) -> list[Route]:
    def setup(request: Request) -> tuple[KeysSettings, KeyStore] | Response:
        runtime = runtime_of(control)
        settings = runtime.config.keys
        if settings is None:
            return problem_response(404, "this configuration has no keys: section")
        return settings, KeyStore(runtime.limiter, runtime.redis.key_prefix)

    async def signalled(store: KeyStore) -> None:
        await Store(store.limiter, store.prefix).changed()

    async def body_of(request: Request, limit: int) -> Any:
        try:
            raw = await bounded_body(request, limit, ADMIN_BODY_TIMEOUT)
        except TooLarge:
            raise _Invalid("", f"the body is at most {limit} bytes") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise _Invalid("", "the body must be JSON") from None

    async def one(request: Request) -> Response:
        found = setup(request)
        if isinstance(found, Response):
            return found
        settings, store = found
        if request.method != "GET" and (refused := write_refusal(control, request)) is not None:
            return refused
        try:
            if request.method == "GET" and "key" not in request.query_params:
                return await by_plan(request, settings, store)
            if "key" not in request.query_params:
                raise _Invalid("key", "give key= (the key, or its fingerprint kf_...)")
            value = _key_digest(request.query_params["key"], request.method != "PUT")
            if request.method == "GET":
                plan = await store.plan(value)
                if plan is None:
                    return problem_response(404, "no such key", key=fingerprint(value))
                return JSONResponse({"key": fingerprint(value), "plan": plan})
            if request.method == "DELETE":
                _, before = await store.write({value: None})
                if not before:
                    return problem_response(404, "no such key", key=fingerprint(value))
                await signalled(store)
                return JSONResponse({"key": fingerprint(value), "deleted": True})
            body = await body_of(request, 4096)
            if not isinstance(body, dict) or set(body) != {"plan"}:
                raise _Invalid("plan", 'the body is {"plan": NAME}')
            plan = _plan(settings, body["plan"])
            await store.write({value: plan})
            await signalled(store)
            return JSONResponse({"key": fingerprint(value), "plan": plan})
        except _Invalid as exc:
            return problem_response(400, f"{exc.field}: {exc}" if exc.field else str(exc), field=exc.field)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis unavailable: {exc}")

    async def by_plan(request: Request, settings: KeysSettings, store: KeyStore) -> Response:
        plan = _plan(settings, request.query_params.get("plan"))
        cursor = request.query_params.get("cursor", "0") or "0"
        text = request.query_params.get("limit", "100")
        limit = int(text) if text.isascii() and text.isdigit() and len(text) < 6 else 0
        if not (cursor.isascii() and cursor.isdigit()) or not 0 < limit <= PAGE_LIMIT:
            raise _Invalid("cursor", f"cursor is the next_cursor of the page before, limit 1 to {PAGE_LIMIT}")
        nxt, pairs = await store.page(cursor, limit)
        return JSONResponse({"plan": plan, "keys": [fingerprint(v) for v, p in pairs if p == plan],
                             "next_cursor": None if nxt == "0" else nxt})

    async def bulk(request: Request) -> Response:
        found = setup(request)
        if isinstance(found, Response):
            return found
        settings, store = found
        if (refused := write_refusal(control, request)) is not None:
            return refused
        try:
            body = await body_of(request, MAX_BULK_BODY)
            items = body.get("keys") if isinstance(body, dict) and set(body) == {"keys"} else None
            if not isinstance(items, list) or not items:
                raise _Invalid("keys", 'the body is {"keys": [{"key": KEY, "plan": PLAN}, ...]}')
            if len(items) > MAX_BULK:
                raise _Invalid("keys", f"at most {MAX_BULK} keys in one call")
            entries: dict[int, str | None] = {}
            for n, item in enumerate(items):
                if not isinstance(item, dict) or set(item) != {"key", "plan"} or not isinstance(item["key"], str):
                    raise _Invalid(f"keys[{n}]", 'each is {"key": KEY, "plan": PLAN}')
                try:
                    entries[_key_digest(item["key"], may_be_fingerprint=False)] = _plan(settings, item["plan"])
                except _Invalid as exc:
                    raise _Invalid(f"keys[{n}].{exc.field}", str(exc)) from None
            await store.write(entries)  # one call: all or none
            await signalled(store)
            return JSONResponse({"written": len(entries)})
        except _Invalid as exc:
            return problem_response(400, f"{exc.field}: {exc}" if exc.field else str(exc), field=exc.field)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis unavailable: {exc}")

    return [Route("/keys", one, methods=["GET", "PUT", "DELETE"]), Route("/keys", bulk, methods=["POST"])]
