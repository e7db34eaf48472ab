"""The admin port, a Starlette app: health and reload (health.py), the rules and keys in force
(limits.py), per-identity overrides (overrides.py), API keys (keys.py) and their consumers
(consumers.py), the console (gateway/admin/console.py). Each endpoint is a module-level handler that finds
the gateway it acts for in the app's state (`common.control_of`).

Writes (DELETE, POST, PUT) need `Authorization: Bearer <admin.token>` when a token is configured (401
without it); with no token they are accepted from loopback peers only, naming a loopback Host, and
without an Origin other than the admin's own (403 otherwise: no CSRF from a page in the operator's
browser, no DNS rebinding).

The admin sees the gateway through `AdminControl` and Redis only through the `Limiter`
(`ping`, `reset`, `decide`): it never talks to a Redis connection itself.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin import health, limits, overrides
from gateway.admin.common import AdminControl, problem_response
from gateway.admin.console import console_routes
from gateway.admin.consumers import consumer_routes
from gateway.admin.keys import key_routes


def admin_app(control: AdminControl) -> Starlette:
    """The admin port's application; `control` is the gateway it reports on and acts for."""
    app = Starlette(
        routes=[
            Route("/healthz", health.healthz, methods=["GET"]),
            Route("/readyz", health.readyz, methods=["GET"]),
            Route("/metrics", health.metrics_text, methods=["GET"]),
            Route("/reload", health.reload, methods=["POST"]),
            Route("/limits", limits.list_limits, methods=["GET"]),
            Route("/limits/{route}/{rule}", limits.one_key, methods=["GET", "DELETE"]),
            Route("/top", limits.top, methods=["GET"]),
            Route("/overrides", overrides.list_overrides, methods=["GET"]),
            Route("/overrides/{route}/{rule}", overrides.one_override, methods=["GET", "PUT", "DELETE"]),
            *key_routes(control),
            *consumer_routes(control),
            *console_routes(control),
        ],
        exception_handlers={HTTPException: http_error},
    )
    app.state.control = control
    return app


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return problem_response(405, f"use {allowed or 'another method'} on {request.url.path[:200]}",
                                headers=exc.headers)
    if exc.status_code == 404:
        return problem_response(404, f"no admin endpoint {request.url.path[:200]}")
    return problem_response(exc.status_code, str(exc.detail))
