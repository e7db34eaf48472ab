"""The admin port's /keys: API keys, their plans and consumers (gateway/api_keys.py).

    PUT    /keys?key=K          {"plan": "pro", "consumer": "acme", "metadata": {...}}: register K, or
                                change it; a consumer or metadata left out is kept (a new key's: a
                                consumer of its own, named by its fingerprint, and none), null clears it
    GET    /keys?key=K          its plan, consumer and metadata
    DELETE /keys?key=K          remove it
    GET    /keys?plan=pro       the plan's keys, fingerprints only, a page at a time (?cursor=&limit=)
    POST   /keys                {"keys": [{"key": K, "plan": P, "consumer": C, "metadata": M}, ...]}:
                                many at once, all or none

K is the key's bytes as the client sends them (percent-escaped), or its fingerprint kf_...: the key
itself is tried first, so a key shaped like a fingerprint is still named by its own value.
A write with a plan not in `keys.plans`, an empty or oversized key, a consumer name that is not one
(CONSUMER), or metadata that is not a JSON object of at most MAX_METADATA_BYTES, is a 400 naming the problem,
and changes nothing; a body past its bound a 413, a stalled one a 408. Writes need the admin token as
every admin write. Every gateway applies a change within about a second (the change signal,
gateway/overrides.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.common import (
    AdminControl,
    admin_body,
    is_cursor,
    json_text,
    problem_response,
    query_bytes,
    runtime_of,
    write_refusal,
)
from gateway.api_keys import (
    MAX_BULK,
    MAX_KEY_BYTES,
    KeyEntry,
    KeyStore,
    digest,
    fingerprint,
    from_fingerprint,
)
from gateway.config import KeysSettings, Source
from gateway.errors import RedisUnavailable
from gateway.identity import cookie_value
from gateway.overrides import Store
from gateway.which_redis import needs_embedded_redis

log = logging.getLogger("gateway.admin")
MAX_BULK_BODY = 2 * 1024 * 1024  # bytes of a POST /keys
PAGE_LIMIT = 1000
# a consumer's name: shown as it is in logs, /top and identities (no ':', which joins identity parts)
CONSUMER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
MAX_METADATA_BYTES = 2048  # a key's metadata, as compact JSON
ENTRY_FIELDS = frozenset({"plan", "consumer", "metadata"})


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


class _Invalid(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _key_bytes(raw: bytes, source: Source) -> bytes:
    """A key as the `keys:` source will read it from a request (gateway/identity.py): surrounding
    whitespace trimmed, a query parameter's invalid UTF-8 as U+FFFD, a cookie's quotes and
    percent-escapes decoded as frameworks decode them (so a key holding % or quotes, sent in the
    cookie as issued, is the key registered)."""
    if not raw.strip():
        raise _Invalid("key", "is empty")
    if len(raw) > MAX_KEY_BYTES:
        raise _Invalid("key", f"is longer than {MAX_KEY_BYTES} bytes")
    if source.kind == "query":
        raw = raw.decode("utf-8", "replace").encode()
    elif source.kind == "cookie":
        raw = cookie_value(raw)
        if not raw:
            raise _Invalid("key", "is empty as a cookie reads it")
    return raw.strip(b" \t")


def _named(raw: bytes, source: Source) -> list[int]:
    """The digests `key=` may name, in the order they are tried: the key itself, then, when it is
    shaped like one, the fingerprint's (a key that looks like a fingerprint is still its own)."""
    named = [digest(_key_bytes(raw, source))]
    if (value := from_fingerprint(raw.decode("latin-1"))) is not None:
        named.append(value)
    return named


def _plan(settings: KeysSettings, value: Any) -> str:
    if not isinstance(value, str) or value not in settings.plans:
        raise _Invalid("plan", f"must be one of {', '.join(settings.plans)} (keys.plans)")
    return value


def _consumer(value: Any, key: int) -> str | None:
    """A named consumer, or None for the key's own (omitted, null, or the key's own fingerprint)."""
    if value is None or value == fingerprint(key):
        return None
    if not isinstance(value, str) or not CONSUMER.match(value):
        raise _Invalid("consumer", "is a name of 1 to 64 letters, digits and . _ @ -, starting with a letter "
                                   "or digit")
    if from_fingerprint(value) is not None or value.startswith("kf_"):
        raise _Invalid("consumer", "kf_... names a key's own consumer: leave consumer out for that")
    return value


def _metadata(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Invalid("metadata", "is a JSON object")
    try:
        compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        raise _Invalid("metadata", "holds a number JSON has no spelling for (NaN, Infinity), or is nested "
                                   "too deep") from None
    if len(compact.encode()) > MAX_METADATA_BYTES:
        raise _Invalid("metadata", f"is at most {MAX_METADATA_BYTES} bytes as compact JSON")
    return value


def _entry(settings: KeysSettings, body: dict[str, Any], key: int) -> KeyEntry:
    """What a write sets: a consumer or metadata the body leaves out is kept as the key has it."""
    return KeyEntry(_plan(settings, body.get("plan")), _consumer(body.get("consumer"), key),
                    _metadata(body.get("metadata")), "consumer" not in body, "metadata" not in body)


def _after(entry: KeyEntry, before: KeyEntry | None) -> KeyEntry:
    """The key as `entry` leaves it, from what it had `before` (None: a new key)."""
    if before is None:
        return entry
    return KeyEntry(entry.plan, before.consumer if entry.keep_consumer else entry.consumer,
                    before.metadata if entry.keep_metadata else entry.metadata)


def shown_entry(value: int, entry: KeyEntry) -> dict[str, Any]:
    """A key as /keys and /consumers show it: its fingerprint, plan, consumer and metadata."""
    return {"key": fingerprint(value), "plan": entry.plan, "consumer": entry.consumer or fingerprint(value),
            "metadata": dict(entry.metadata or {})}


def key_routes(control: AdminControl) -> list[Route]:
    def setup(request: Request) -> tuple[KeysSettings, KeyStore] | Response:
        runtime = runtime_of(control)
        settings = runtime.config.keys
        if settings is None:
            return problem_response(404, "this configuration has no keys: section")
        return settings, KeyStore(runtime.limiter, runtime.redis.key_prefix)

    def kept_in_memory() -> dict[str, Any]:
        """What a write's answer adds when the embedded Redis was started --ephemeral."""
        settings = control.settings
        if not (settings.ephemeral and needs_embedded_redis(settings, runtime_of(control).config)):
            return {}
        warning = ("the embedded Redis keeps keys in memory only (--ephemeral, or no state directory: see the start-up "
                   "log): they are gone when the "
                   "gateway stops (serve without --ephemeral keeps them, or set a Redis URL)")
        log.warning("API keys written: %s", warning)
        return {"survives_restart": False, "warning": warning}

    async def signalled(store: KeyStore) -> None:
        await Store(store.limiter, store.prefix).changed()

    async def body_of(request: Request, limit: int) -> Any:
        raw = await admin_body(request, limit)
        if isinstance(raw, Response):
            raise _Refused(raw)
        try:
            return json_text(raw)
        except RecursionError:
            raise _Invalid("", "the body must be JSON") from None
        except ValueError as exc:
            raise _Invalid("", f"the body must be JSON: {exc}") from None

    async def existing(store: KeyStore, named: list[int]) -> tuple[int, KeyEntry | None]:
        """The first of `named` that is registered, with its entry; else the last, with None."""
        for value in named:
            if (entry := await store.entry(value)) is not None:
                return value, entry
        return named[-1], None

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
            given = query_bytes(request, "key")
            if len(given) != 1:
                raise _Invalid("key", "give one key= (the key, or its fingerprint kf_...)")
            named = _named(given[0], settings.source)
            value, registered = await existing(store, named)
            if request.method == "GET":
                if registered is None:
                    return problem_response(404, "no such key", key=fingerprint(value))
                return JSONResponse(shown_entry(value, registered))
            if request.method == "DELETE":
                if registered is None:
                    return problem_response(404, "no such key", key=fingerprint(value))
                await store.write({value: None})
                await signalled(store)
                return JSONResponse({"key": fingerprint(value), "deleted": True})
            body = await body_of(request, 4096)
            if not isinstance(body, dict) or "plan" not in body or not set(body) <= ENTRY_FIELDS:
                raise _Invalid("plan", 'the body is {"plan": NAME}, with "consumer": NAME and "metadata": '
                                       '{...} if wanted')
            if registered is None:
                value = named[0]  # a new key: registered as given, even one shaped like a fingerprint
            entry = _entry(settings, body, value)
            await store.write({value: entry})
            await signalled(store)
            return JSONResponse(shown_entry(value, _after(entry, registered)) | kept_in_memory())
        except _Refused as exc:
            return exc.response
        except _Invalid as exc:
            return problem_response(400, f"{exc.field}: {exc}" if exc.field else str(exc), field=exc.field)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis unavailable: {exc}")

    async def by_plan(request: Request, settings: KeysSettings, store: KeyStore) -> Response:
        plan = _plan(settings, request.query_params.get("plan"))
        cursor = request.query_params.get("cursor", "0") or "0"
        text = request.query_params.get("limit", "100")
        limit = int(text) if text.isascii() and text.isdigit() and len(text) < 6 else 0
        if not is_cursor(cursor):
            raise _Invalid("cursor", "is the next_cursor of the page before")
        if not 0 < limit <= PAGE_LIMIT:
            raise _Invalid("limit", f"is a whole number from 1 to {PAGE_LIMIT}")
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
            entries: dict[int, KeyEntry | None] = {}
            for n, item in enumerate(items):
                if (not isinstance(item, dict) or not {"key", "plan"} <= set(item) <= ENTRY_FIELDS | {"key"}
                        or not isinstance(item["key"], str)):
                    raise _Invalid(f"keys[{n}]", 'each is {"key": KEY, "plan": PLAN}, with "consumer": NAME and '
                                                 '"metadata": {...} if wanted')
                try:
                    value = digest(_key_bytes(item["key"].encode("utf-8", "surrogateescape"), settings.source))
                    entries[value] = _entry(settings, item, value)
                except _Invalid as exc:
                    raise _Invalid(f"keys[{n}].{exc.field}", str(exc)) from None
            await store.write(entries)  # one call: all or none
            await signalled(store)
            return JSONResponse({"written": len(entries)} | kept_in_memory())
        except _Refused as exc:
            return exc.response
        except _Invalid as exc:
            return problem_response(400, f"{exc.field}: {exc}" if exc.field else str(exc), field=exc.field)
        except RedisUnavailable as exc:
            return problem_response(503, f"Redis unavailable: {exc}")

    return [Route("/keys", one, methods=["GET", "PUT", "DELETE"]), Route("/keys", bulk, methods=["POST"])]
