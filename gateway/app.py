"""The gateway as one plain ASGI app: match -> identity -> limiter -> forward | refuse.

The admin endpoints share the process but never the port: a request is an admin request only when
it arrived on the admin socket.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import metrics
from gateway.admin import Admin
from gateway.breaker import Breaker, BreakerState
from gateway.config import Config, Rule, load_config
from gateway.errors import (
    BadRequest,
    ConfigError,
    IdentityMissing,
    RedisUnavailable,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.identity import RequestView, rule_identity
from gateway.keys import identity_token
from gateway.limiter import Decision, Limiter, Outcome
from gateway.proxy import HOP_BY_HOP, ClientDisconnected, ClientTooSlow, RequestBody, hop_by_hop
from gateway.redis import make_runner
from gateway.responses import Headers, problem, ratelimit_headers, refusal
from gateway.runtime import RoutePlan, Runtime, build_runtime
from gateway.settings import Settings, redis_settings

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("gateway")
access_log = logging.getLogger("gateway.access")

MAX_COST_HEADER = 1_000_000_000
METRICS_FLUSH_INTERVAL = 1.0
REQUEST_ID_MAX = 128
STRIPPED_REQUEST = frozenset({
    b"host", b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-request-id",
    b"expect", b"content-length",
})
REQUEST_DROP = HOP_BY_HOP | STRIPPED_REQUEST


class Gateway:
    def __init__(self, settings: Settings, config: Config | None = None) -> None:
        self.settings = settings
        self.initial_config = config
        self.runtime: Runtime | None = None
        self.admin = Admin(self)
        self.ready = False
        self._flusher: asyncio.Task[None] | None = None
        self._reload_waiters: list[asyncio.Future[tuple[bool, str]]] = []
        self._reload_pending = False

    # --- lifecycle -------------------------------------------------------------------------

    def make_limiter(self, config: Config) -> Limiter:
        redis = redis_settings(self.settings, config)
        return Limiter(make_runner(redis), Breaker(), observe=_observe_redis, on_breaker=_breaker_changed)

    async def startup(self) -> None:
        config = self.initial_config or load_config(self.settings.config_path)
        redis = redis_settings(self.settings, config)
        self.runtime = build_runtime(config, redis, self.make_limiter(config))
        metrics.CONFIG_INFO.set(len(config.routes))
        self._flusher = asyncio.get_running_loop().create_task(self._flush_metrics())
        # What exists now lives as long as the worker: keep the collector from walking it again
        # and again (full collections paused every request in flight for ~30 ms).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        self.ready = True
        if self._reload_pending:
            self._reload_pending = False
            self.reload()

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_INTERVAL)
            metrics.flush()

    async def shutdown(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        metrics.flush()
        runtime = self.runtime
        if runtime is None:
            return
        for pool in runtime.pools.values():
            await pool.close()
        await runtime.limiter.close()

    def reload(self) -> tuple[bool, str]:
        """Validate the file and swap it in; on any error the old config stays in force."""
        if self.runtime is None:  # asked before start-up finished: done once it has
            self._reload_pending = True
            return True, "deferred until start-up completes"
        try:
            result = self._reload()
        except Exception as exc:  # a reload must never take the worker down
            log.exception("reload failed, keeping the current config")
            metrics.RELOADS.labels("error").inc()
            result = False, f"reload failed: {exc.__class__.__name__}: {exc}"
        waiters, self._reload_waiters = self._reload_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(result)
        return result

    def next_reload(self) -> asyncio.Future[tuple[bool, str]]:
        """The outcome of this worker's next reload (one the supervisor passes on, say)."""
        waiter: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(waiter)
        return waiter

    def _reload(self) -> tuple[bool, str]:
        try:
            config = load_config(self.settings.config_path)
        except ConfigError as exc:
            metrics.RELOADS.labels("error").inc()
            log.error("reload refused, keeping the current config:\n%s", exc)
            return False, str(exc)
        old = self.runtime
        assert old is not None
        redis = redis_settings(self.settings, config)
        limiter = old.limiter if redis == old.redis else self.make_limiter(config)
        new = build_runtime(config, redis, limiter, reuse=old.pools)
        self.runtime = new
        metrics.RELOADS.labels("ok").inc()
        metrics.CONFIG_INFO.set(len(config.routes))
        log.info("reloaded %s: %d routes", self.settings.config_path, len(config.routes))
        asyncio.get_running_loop().create_task(self._retire(old, new))
        return True, f"{len(config.routes)} routes"

    async def _retire(self, old: Runtime, new: Runtime) -> None:
        old.retired = True
        if old.in_flight:
            await old.drained.wait()
        for name, pool in old.pools.items():
            if new.pools.get(name) is not pool:
                await pool.close()
        if new.limiter is not old.limiter:
            await old.limiter.close()

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            server = scope.get("server")
            if server is not None and server[1] == self.settings.admin_port:
                await self.admin.handle(scope, receive, send)
            else:
                await self.handle(scope, receive, send)
        elif kind == "lifespan":
            await self.lifespan(receive, send)
        # websockets are not proxied: uvicorn answers 403 when the app does not accept

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except ConfigError as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self.runtime
        assert runtime is not None
        runtime.enter()
        started = time.perf_counter()
        route_name, outcome, rule_name, status = "", "", "", 0
        request_id = ""
        try:
            request_id = _request_id(scope)
            route_name, outcome, rule_name, status = await self._handle(
                runtime, scope, receive, send, request_id
            )
        finally:
            runtime.leave()
            if route_name:
                metrics.requests(route_name, outcome).inc()
                metrics.responses(route_name, str(abs(status))).inc()
            if runtime.config.access_log:
                access_log.info(json.dumps({
                    "request_id": request_id,
                    "method": scope.get("method"),
                    "path": scope.get("path", "")[:512],
                    "client": (scope.get("client") or ("",))[0],
                    "route": route_name or None,
                    "decision": outcome,
                    "rule": rule_name or None,
                    "status": abs(status),
                    "latency_ms": round((time.perf_counter() - started) * 1000, 3),
                }))

    async def _handle(
        self, runtime: Runtime, scope: Scope, receive: Receive, send: Send, request_id: str
    ) -> tuple[str, str, str, int]:
        method: str = scope["method"]
        host = _host(scope)
        found = runtime.router.match(method, host, scope["path"])
        if found is None:
            status = await _answer(send, problem(404, f"no route matches {method} {scope['path'][:200]}"), request_id)
            return "", "no_route", "", status
        route, params = found
        plan = runtime.plans[route.name]
        view = RequestView(scope, params, runtime.config, runtime.jwt)

        more_body = _has_body(scope)
        if plan.needs_body and more_body:
            view.body_prefix, more_body = await _read_prefix(receive, runtime.config.body_digest_max_bytes)
            if view.body_prefix is None:
                return route.name, "client_gone", "", 499
        elif plan.needs_body:
            view.body_prefix = b""

        rules: list[Rule] = []      # the rules this request has identities for
        keys: list[str] = []        # one per rule of the route ...
        costs: list[int | None] = []  # ... None where the rule sits out (on_missing: skip)
        try:
            for i, rule in enumerate(plan.rules):
                parts = rule_identity(rule, view)
                if parts is None:
                    keys.append(plan.prefix_keys[i])
                    costs.append(None)
                    continue
                rules.append(rule)
                keys.append(plan.prefix_keys[i] + identity_token(parts))
                costs.append(_cost(rule.cost, rule.cost_header, view))
        except IdentityMissing as exc:
            status = await _answer(send, problem(400, str(exc), route=route.name, rule=exc.rule), request_id)
            return route.name, "bad_request", exc.rule, status
        except BadRequest as exc:
            status = await _answer(send, problem(400, str(exc), route=route.name), request_id)
            return route.name, "bad_request", "", status

        extra: Headers = []
        outcome = "admitted"
        if rules:
            try:
                decision = await runtime.limiter.decide(plan.args, keys, costs)
            except RedisUnavailable as exc:
                metrics.REDIS_ERRORS.labels(exc.kind).inc()
                if route.failure_mode == "closed":
                    body = problem(503, "rate limiting is unavailable; try again shortly", route=route.name)
                    body[1].append((b"retry-after", b"1"))
                    status = await _answer(send, body, request_id)
                    return route.name, "failed_closed", "", status
                outcome = "failed_open"
            else:
                _count_rules(route.name, rules, decision)
                if not decision.admitted:
                    assert decision.refused_by is not None
                    status = await _answer(send, refusal(route, rules, decision), request_id)
                    return route.name, "refused", rules[decision.refused_by].name, status
                extra = ratelimit_headers(route.headers, rules, decision)
                if decision.delay_ms > 0:
                    await asyncio.sleep(decision.delay_ms / 1000)

        status = await self._forward(plan, scope, receive, send, view, more_body, extra, request_id)
        return route.name, outcome, "", status

    async def _forward(
        self,
        plan: RoutePlan,
        scope: Scope,
        receive: Receive,
        send: Send,
        view: RequestView,
        more_body: bool,
        extra: Headers,
        request_id: str,
    ) -> int:
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        incoming = view.headers
        drop = hop_by_hop(raw_headers) | STRIPPED_REQUEST if b"connection" in incoming else REQUEST_DROP
        headers = [(k, v) for k, v in raw_headers if k not in drop]
        peer = (scope.get("client") or ("0.0.0.0",))[0].encode()
        xff = incoming.get(b"x-forwarded-for")
        headers.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
        headers.append((b"x-forwarded-proto", b"https" if scope.get("scheme") == "https" else b"http"))
        original_host = incoming.get(b"host")
        if original_host:
            headers.append((b"x-forwarded-host", original_host))
        request_id_bytes = request_id.encode()
        headers.append((b"x-request-id", request_id_bytes))
        length = incoming.get(b"content-length")
        if length is not None:
            headers.append((b"content-length", length))
        body = None
        if more_body or view.body_prefix:
            body = RequestBody(view.body_prefix or b"", more_body, receive)
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string")
        if query:
            target = target + b"?" + query
        response_headers = [*extra, (b"x-request-id", request_id_bytes)]
        pool = plan.pool
        started = time.perf_counter()
        try:
            status = await pool.forward(
                scope["method"].encode(), target, headers, body, send, response_headers
            )
        except UpstreamTimeout as exc:
            metrics.upstream_errors(pool.upstream.name, "timeout").inc()
            return await _answer(send, problem(504, str(exc)), request_id)
        except UpstreamUnavailable as exc:
            metrics.upstream_errors(pool.upstream.name, "unavailable").inc()
            return await _answer(send, problem(502, str(exc)), request_id)
        except ClientTooSlow:
            return await _answer(send, problem(408, "the request body stopped arriving"), request_id)
        except ClientDisconnected:
            return 499
        metrics.upstream_latency(pool.upstream.name).observe(time.perf_counter() - started)
        if status < 0:
            metrics.upstream_errors(pool.upstream.name, "aborted").inc()
        return status


# --- helpers -----------------------------------------------------------------------------------


def _observe_redis(seconds: float, ok: bool) -> None:
    metrics.redis_latency("ok" if ok else "error").observe(seconds)


def _breaker_changed(state: BreakerState) -> None:
    metrics.BREAKER.set(int(state))


def _count_rules(route: str, rules: list[Any], decision: Decision) -> None:
    for rule, state in zip(rules, decision.rules, strict=True):
        if state.outcome is Outcome.SHADOW_REFUSES:
            metrics.rule_decisions(route, rule.name, "shadow_refused").inc()
        elif state.outcome is not Outcome.ADMITS:
            metrics.rule_decisions(route, rule.name, "refused").inc()
        elif decision.admitted:
            metrics.rule_decisions(route, rule.name, "admitted").inc()


async def _answer(send: Send, response: tuple[int, Headers, bytes], request_id: str) -> int:
    status, headers, body = response
    headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return status


_ID_PREFIX = os.urandom(10).hex()  # per process; with the counter, unique without a syscall
_ID_COUNTER = itertools.count()


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if 0 < len(value) <= REQUEST_ID_MAX and all(33 <= c < 127 for c in value):
                return str(value.decode("ascii"))
            break
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


def _host(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"host":
            text = value.decode("latin-1").lower()
            if text.startswith("["):
                return str(text.split("]")[0] + "]")
            return str(text.rsplit(":", 1)[0] if ":" in text else text)
    return ""


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


async def _read_prefix(receive: Receive, limit: int) -> tuple[bytes | None, bool]:
    """Read up to `limit` bytes of the body (whole messages); None if the client went away."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more and size < limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, False
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)
    return data, more


def _cost(fixed: int, header: str | None, view: RequestView) -> int:
    if header is None:
        return fixed
    raw = view.headers.get(header.encode())
    if raw is None:
        return fixed
    text = raw.strip()
    if not text.isdigit() or len(text) > 10 or not 0 < int(text) <= MAX_COST_HEADER:
        raise BadRequest(f"header {header} must be a whole number from 1 to {MAX_COST_HEADER}")
    return int(text)
