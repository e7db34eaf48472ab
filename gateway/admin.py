"""The admin port: health, readiness, metrics, inspect/reset one key, reload.

Writes (DELETE, POST) need `Authorization: Bearer <admin.token>` when a token is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from gateway import metrics
from gateway.config import load_config
from gateway.errors import ConfigError, RedisUnavailable
from gateway.keys import identity_token
from gateway.limiter import Outcome
from gateway.responses import Headers, problem

if TYPE_CHECKING:
    from gateway.app import Gateway

RELOAD_WAIT = 5.0  # seconds for the supervisor to pass a POST /reload on to this worker

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Response = tuple[int, Headers, bytes]


def _json(status: int, payload: dict[str, Any]) -> Response:
    body = json.dumps(payload).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class Admin:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            response = await self.route(scope)
        except RedisUnavailable as exc:
            response = problem(503, f"Redis is unavailable: {exc}")
        status, headers, body = response
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def authorized(self, scope: dict[str, Any]) -> bool:
        runtime = self.gateway.runtime
        token = runtime.config.admin_token if runtime else None
        if not token:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, b"Bearer " + token.encode())
        return False

    async def route(self, scope: dict[str, Any]) -> Response:
        method, path = scope["method"], scope["path"]
        if path == "/healthz" and method == "GET":
            return _json(200, {"status": "ok"})
        if path == "/readyz" and method == "GET":
            return await self.readyz()
        if path == "/metrics" and method == "GET":
            data, content_type = metrics.render()
            return 200, [(b"content-type", content_type.encode())], data
        if path == "/reload":
            if method != "POST":
                return problem(405, "use POST /reload")
            if not self.authorized(scope):
                return problem(401, "admin token required")
            return await self.reload()
        if path.startswith("/limits/"):
            parts = path.split("/")
            if len(parts) != 4:
                return problem(404, "use /limits/{route}/{rule}?key=...")
            if method == "DELETE" and not self.authorized(scope):
                return problem(401, "admin token required")
            if method not in ("GET", "DELETE"):
                return problem(405, "use GET or DELETE")
            return await self.limits(method, parts[2], parts[3], scope.get("query_string", b""))
        return problem(404, f"no admin endpoint {path[:200]}")

    async def readyz(self) -> Response:
        runtime = self.gateway.runtime
        if runtime is None or not self.gateway.ready:
            return problem(503, "configuration not loaded yet")
        try:
            await runtime.limiter.ping()
        except RedisUnavailable as exc:
            return problem(503, f"Redis is not answering: {exc}")
        return _json(200, {"status": "ready", "routes": len(runtime.config.routes)})

    async def reload(self) -> Response:
        if os.environ.get("GATEWAY_SUPERVISED") == "1":
            try:
                ok, message = await self._reload_every_worker()
            except TimeoutError:
                return problem(503, f"the supervisor did not pass the reload on within {RELOAD_WAIT:.0f}s")
        else:
            ok, message = self.gateway.reload()
        if not ok:
            return problem(422, "the new configuration is invalid; the old one stays in force",
                           errors=message.splitlines())
        return _json(200, {"reloaded": True, "detail": message})

    async def _reload_every_worker(self) -> tuple[bool, str]:
        """Validate here, then let the supervisor signal every worker (this one included, so each
        reloads once) and answer with this worker's own outcome."""
        try:
            load_config(self.gateway.settings.config_path)
        except ConfigError as exc:
            metrics.RELOADS.labels("error").inc()
            return False, str(exc)
        outcome = self.gateway.next_reload()
        os.kill(os.getppid(), signal.SIGHUP)
        return await asyncio.wait_for(outcome, RELOAD_WAIT)

    async def limits(self, method: str, route_name: str, rule_name: str, query: bytes) -> Response:
        runtime = self.gateway.runtime
        assert runtime is not None
        plan = runtime.plans.get(route_name)
        if plan is None:
            return problem(404, f"no route {route_name[:100]!r}")
        index = next((i for i, r in enumerate(plan.rules) if r.name == rule_name), None)
        if index is None:
            return problem(404, f"route {route_name!r} has no rule {rule_name[:100]!r}")
        rule = plan.rules[index]
        values = [v.encode() for k, v in parse_qsl(query.decode("latin-1")) if k == "key"]
        if len(values) != len(rule.by):
            sources = ", ".join(str(s) for s in rule.by) or "none"
            return problem(400, f"give one key= per identity source of the rule ({sources})")
        key = plan.prefix_keys[index] + identity_token(values)
        if method == "DELETE":
            deleted = await runtime.limiter.reset(key)
            return _json(200, {"route": route_name, "rule": rule_name, "key": key, "reset": deleted})
        decision = await runtime.limiter.decide([plan.args[index]], [key], [0], peek=True)
        state = decision.rules[0]
        return _json(200, {
            "route": route_name,
            "rule": rule_name,
            "algorithm": rule.algorithm,
            "key": key,
            "limit": rule.quota_size,
            "remaining": state.remaining,
            "reset_ms": state.reset_ms,
            "exhausted": state.outcome is not Outcome.ADMITS or state.remaining <= 0,
        })
