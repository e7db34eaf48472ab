"""The gateway as a Starlette application: match -> identity -> limiter -> forward | refuse.

`build_app()` makes the application uvicorn serves: the admin app (gateway/admin.py) for requests
that arrived on the admin socket, and the proxy endpoint, a pure ASGI callable routed the rest:
`read_request` (gateway/http/request.py) checks and normalizes the request, the router picks the
route, `judge` (gateway/guard.py) makes the one limiter call, and the upstream client
(gateway/proxy.py) forwards what is admitted. The lifespan opens and closes the pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import URLPath
from starlette.requests import Request as StarletteRequest
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import metrics
from gateway.admin import admin_app
from gateway.config import Config, load_config
from gateway.errors import BadRequest, ConfigError, UpstreamTimeout, UpstreamUnavailable
from gateway.guard import Verdict, held_decision, held_refusal, judge
from gateway.http.request import Request, read_request
from gateway.http.server import head_lines
from gateway.identity import RequestView
from gateway.limiter import Limiter
from gateway.proxy import ClientDisconnected, ClientTooSlow, RequestBody
from gateway.repeats import Seen, request_key
from gateway.responses import Headers, problem, refusal, send_answer
from gateway.runtime import RoutePlan, Runtime, build_runtime, new_limiter
from gateway.settings import Settings, redis_settings

log = logging.getLogger("gateway")
access_log = logging.getLogger("gateway.access")

METRICS_FLUSH_INTERVAL = 1.0
_CHECKED = "gateway.checked"  # scope key: the Request and route match held_refusal computed
REQUEST_ID_MAX = 128


class Gateway:
    def __init__(self, settings: Settings, config: Config | None = None) -> None:
        self.settings = settings
        self.initial_config = config
        self.runtime: Runtime | None = None
        # the admin port's Starlette app, built once (typed with Starlette's wider ASGI aliases)
        self.admin = admin_app(self)
        self.ready = False
        self._flusher: asyncio.Task[None] | None = None
        self._reload_waiters: list[asyncio.Future[tuple[bool, str]]] = []
        self._reload_pending = False

    # --- lifecycle -------------------------------------------------------------------------

    def make_limiter(self, config: Config) -> Limiter:
        redis = redis_settings(self.settings, config)
        return new_limiter(redis)

    async def startup(self) -> None:
        config = self.initial_config or load_config(self.settings.config_path)
        redis = redis_settings(self.settings, config)
        self.runtime = build_runtime(config, redis, self.make_limiter(config),
                                     transport=self.settings.upstream_transport)
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
        for client in runtime.clients.values():
            await client.close()
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
        new = build_runtime(config, redis, limiter, reuse=old.clients, transport=self.settings.upstream_transport)
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
        for name, client in old.clients.items():
            if new.clients.get(name) is not client:
                await client.close()
        if new.limiter is not old.limiter:
            await old.limiter.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    # --- the proxy endpoint (pure ASGI, mounted in the Starlette app) ---------------------------

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self.runtime
        assert runtime is not None
        runtime.enter()
        started = time.perf_counter()
        route_name, outcome, rule_name, status = "", "", "", 0
        request_id = b""
        try:
            request_id, route_name, outcome, rule_name, status = await self._proxy(runtime, scope, receive, send)
        finally:
            runtime.leave()
            _account(runtime, scope, request_id, route_name, outcome, rule_name, status, started)

    def held_refusal(self, scope: Scope) -> bytes | None:
        """For the server protocol, before the application is entered: the refusal held in memory
        for this request (gateway/refusals.py), as the whole keep-alive response to send; None: the
        app serves it. A request answered so before, byte for byte, is not read again, and the
        same refusal is not rendered again (gateway/repeats.py)."""
        runtime = self.runtime
        server = scope.get("server")
        if runtime is None or not runtime.refusals or server is None or server[1] == self.settings.admin_port:
            return None  # nothing held (the common case), or not a proxy request
        started = time.perf_counter()
        key = request_key(scope)
        seen = runtime.repeats.get(key)
        if seen is None:
            try:
                request = read_request(scope, self.settings.max_head_bytes)
            except BadRequest:
                return None
            found = runtime.router.match(request.method, request.hostname, request.path)
            scope[_CHECKED] = (runtime, request, found)  # if nothing is held, the app reads no further
            if found is None:
                return None
            route, params = found
            plan = runtime.plans[route.name]
            held = held_refusal(runtime, plan, RequestView(request, params, runtime.config, runtime.jwt))
            if held is None:
                return None
            identified, decision = held
            seen = Seen(route, identified.rules, identified.keys, identified.costs,
                        _usable_request_id(request.request_id))
            if plan.repeatable:
                runtime.repeats.put(key, seen)
        else:
            found_decision = held_decision(runtime, seen.route, seen.rules, seen.keys, seen.costs)
            if found_decision is None:
                return None  # no longer held: the whole way (the app reads the request itself)
            decision = found_decision
        rendered = seen.rendered
        if rendered is None or rendered[0] != decision:
            status, headers, body = refusal(seen.route, seen.rules, decision)
            rendered = seen.rendered = decision, head_lines(status, headers), body
        _, head, body = rendered
        request_id = seen.request_id or _new_request_id()
        by = decision.refused_by
        assert by is not None  # a held decision is a refusal
        rule = seen.rules[by]
        _account(runtime, scope, request_id, seen.route.name, "refused_locally", rule.name, rule.status, started)
        return b"".join((head, b"x-request-id: ", request_id, b"\r\n\r\n", body))

    async def _proxy(
        self, runtime: Runtime, scope: Scope, receive: Receive, send: Send
    ) -> tuple[bytes, str, str, str, int]:
        checked = scope.pop(_CHECKED, None)
        if checked is not None and checked[0] is runtime:  # read and matched by held_refusal already
            _, request, found = checked
        else:
            try:
                request = read_request(scope, self.settings.max_head_bytes)
            except BadRequest as exc:
                answer = problem(exc.status, str(exc))
                answer[1].append((b"connection", b"close"))  # the framing is in doubt: no next request
                request_id = _new_request_id()
                return request_id, "", "bad_request", "", await _answer(send, answer, request_id)
            found = runtime.router.match(request.method, request.hostname, request.path)
        request_id = _request_id(request.request_id)
        if found is None:
            host = request.hostname
            allowed = runtime.router.allowed_methods(host, request.path)
            if allowed:  # a route owns this path under other methods: a catch-all may not take it
                methods = ", ".join(sorted(allowed))
                answer = problem(405, f"{request.method} is not allowed on {request.path[:200]}; use {methods}")
                answer[1].append((b"allow", methods.encode()))
                return request_id, "", "method_not_allowed", "", await _answer(send, answer, request_id)
            answer = problem(404, f"no route matches {request.method} {request.path[:200]}")
            return request_id, "", "no_route", "", await _answer(send, answer, request_id)
        route, params = found
        plan = runtime.plans[route.name]
        view = RequestView(request, params, runtime.config, runtime.jwt)
        verdict = await judge(runtime, plan, view, receive)
        if verdict.answer is not None:
            status = await _answer(send, verdict.answer, request_id)
            return request_id, route.name, verdict.outcome, verdict.rule, status
        if verdict.outcome == "client_gone":
            return request_id, route.name, "client_gone", "", 499
        if verdict.delay_ms > 0:
            await asyncio.sleep(verdict.delay_ms / 1000)
        status = await self._forward(plan, request, receive, send, verdict, request_id)
        return request_id, route.name, verdict.outcome, "", status

    async def _forward(
        self, plan: RoutePlan, request: Request, receive: Receive, send: Send, verdict: Verdict,
        request_id: bytes,
    ) -> int:
        client = plan.client
        assert client is not None
        body = None
        if verdict.more_body or verdict.body_prefix:
            body = RequestBody(verdict.body_prefix or b"", verdict.more_body, receive)
        response_headers = [*verdict.headers, (b"x-request-id", request_id)]
        name = client.upstream.name
        started = time.perf_counter()
        try:
            forwarded = await client.forward(request, body, send, response_headers, request_id)
        except UpstreamTimeout as exc:
            metrics.upstream_errors(name, "timeout").inc()
            return await _answer(send, problem(504, str(exc)), request_id)
        except UpstreamUnavailable as exc:
            metrics.upstream_errors(name, "unavailable").inc()
            return await _answer(send, problem(502, str(exc)), request_id)
        except ClientTooSlow:
            return await _answer(send, problem(408, "the request body stopped arriving"), request_id)
        except ClientDisconnected:
            return 499
        metrics.upstream_latency(name).observe(time.perf_counter() - started)
        if forwarded.aborted:
            metrics.upstream_errors(name, "aborted").inc()
        return forwarded.status


# --- helpers -----------------------------------------------------------------------------------


async def _answer(send: Send, response: tuple[int, Headers, bytes], request_id: bytes) -> int:
    response[1].append((b"x-request-id", request_id))
    return await send_answer(send, response)


_ID_PREFIX = os.urandom(10).hex().encode()  # per process; with the counter, unique without a syscall
_ID_COUNTER = itertools.count()


def _new_request_id() -> bytes:
    return b"%s%012x" % (_ID_PREFIX, next(_ID_COUNTER))


def _request_id(sent: bytes | None) -> bytes:
    return _usable_request_id(sent) or _new_request_id()


def _usable_request_id(sent: bytes | None) -> bytes | None:
    if sent is not None and 0 < len(sent) <= REQUEST_ID_MAX and all(33 <= c < 127 for c in sent):
        return sent
    return None


def _account(runtime: Runtime, scope: Scope, request_id: bytes, route_name: str, outcome: str, rule_name: str,
             status: int, started: float) -> None:
    """Metrics and the access log line of one request."""
    if route_name:
        metrics.requests(route_name, outcome).inc()
        metrics.responses(route_name, str(status)).inc()
    if runtime.config.access_log:
        access_log.info(json.dumps({
            "request_id": request_id.decode("latin-1"),
            "method": scope.get("method"),
            "path": scope.get("path", "")[:512],
            "client": (scope.get("client") or ("",))[0],
            "route": route_name or None,
            "decision": outcome,
            "rule": rule_name or None,
            "status": status,
            "latency_ms": round((time.perf_counter() - started) * 1000, 3),
        }))


# --- the application --------------------------------------------------------------------------


class _Endpoint(BaseRoute):
    """A route to one ASGI app, matched by something other than a path template; never reversed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


_FULL: tuple[Match, Scope] = (Match.FULL, {})
_NONE: tuple[Match, Scope] = (Match.NONE, {})


class AdminPort(_Endpoint):
    """Routes a request to the admin app when it arrived on the admin socket: the two share the
    process, never the port."""

    def __init__(self, port: int, app: ASGIApp) -> None:
        super().__init__(app)
        self.port = port

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == self.port:
            return _FULL
        return _NONE


class Proxied(_Endpoint):
    """Every other HTTP request, to the proxy endpoint as it came: its path is matched by the
    gateway's own router (gateway/match.py), so no prefix is split off and no path parameters are
    added here, as a `Mount("")` would for each request."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return _FULL if scope["type"] == "http" else _NONE


def build_app(settings: Settings, config: Config | None = None) -> Starlette:
    """The gateway's Starlette application: the admin app on the admin port, the proxy endpoint
    (pure ASGI) for everything else, pools opened and closed by the lifespan."""
    gateway = Gateway(settings, config)
    app = Starlette(
        routes=[
            AdminPort(settings.admin_port, gateway.admin),
            Proxied(gateway.proxy),
        ],
        lifespan=gateway.lifespan,
        exception_handlers={Exception: _internal_error},
    )
    app.state.gateway = gateway
    return app


async def _internal_error(request: StarletteRequest, exc: Exception) -> Response:
    status, headers, body = problem(500, "the gateway failed to handle the request")
    return Response(body, status, headers={k.decode(): v.decode() for k, v in headers})
