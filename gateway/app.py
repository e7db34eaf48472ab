"""The composition root: settings -> lifecycle (config, runtime) -> the worker's application.

The check port's requests go to the check endpoint (gateway/check.py) as the server protocol's door
for that port (`Composed.doors`): called with the request, it returns the whole answer, which the
server writes at once. `Doors` hands a request on the proxy port to the proxy endpoint
(gateway/endpoint.py); both endpoints take it through the pipeline (gateway/pipeline.py).
Everything else goes to the Starlette application: the admin socket's requests to the admin app
(gateway/admin/), any other socket's to the proxy endpoint, and the lifespan, which opens and
closes the pools. A server without doors (uvicorn's own protocol, compared in the tests) reaches
the check endpoint through `Doors` as an ASGI app.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import URLPath
from starlette.requests import Request as StarletteRequest
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import tracing
from gateway.accounting import Accounting
from gateway.admin import admin_app
from gateway.check import CheckEndpoint
from gateway.config import Config
from gateway.endpoint import ProxyEndpoint
from gateway.http.early import Door
from gateway.lifecycle import Lifecycle
from gateway.outcome import RequestBounds
from gateway.responses import problem
from gateway.rls.server import GrpcServer
from gateway.rls.service import HEALTH_CHECK, SHOULD_RATE_LIMIT, RateLimitService, health
from gateway.settings import Settings


@dataclass(frozen=True)
class Composed:
    app: ASGIApp  # Doors: the hot ports straight to their endpoint, the rest through Starlette
    lifecycle: Lifecycle
    endpoint: ProxyEndpoint  # its `answer_early` is the server protocol's early path
    rls_server: GrpcServer | None = None  # Envoy's rate limit service, on its own socket (--rls-port)
    doors: dict[int, Door] = field(default_factory=dict)  # the server protocol's: port -> its one endpoint


def compose(settings: Settings, config: Config | None = None, transport: str = "lean") -> Composed:
    """The gateway's application; `transport` "httpx" is for the comparison in tests and bench only."""
    lifecycle = Lifecycle(settings, config, transport)
    limits = RequestBounds(settings.max_head_bytes, settings.body_timeout)
    accounting = tracing.accounted(Accounting(lifecycle.top))
    endpoint = ProxyEndpoint(lifecycle.current, limits, settings.port, accounting)
    proxy = tracing.served(endpoint, "proxy")
    by_port = {settings.port: proxy}  # Doors takes these before Starlette
    doors: dict[int, Door] = {}
    if settings.check_port is not None:
        check = CheckEndpoint(lifecycle.current, limits, accounting)
        doors[settings.check_port] = tracing.door(check, "check")
        by_port[settings.check_port] = tracing.served(check.asgi, "check")
    app = Starlette(
        routes=[AdminPort(settings.admin_port, admin_app(lifecycle)), Proxied(proxy)],
        lifespan=lifecycle.lifespan,
        exception_handlers={Exception: _internal_error},
    )
    rls_server = None
    if settings.rls_port is not None:
        service = RateLimitService(lifecycle.current)
        rls_server = GrpcServer({SHOULD_RATE_LIMIT.encode(): tracing.rls_call(service.should_rate_limit)},
                                {HEALTH_CHECK.encode(): lambda body: health(body, lifecycle.current())},
                                settings.rls_idle_timeout, body_timeout=settings.rls_body_timeout)
    return Composed(Doors(app, by_port), lifecycle, endpoint, rls_server, doors)


class Doors:
    """The worker's ASGI application. A request on the proxy port (or on the check port, under a
    server without doors) goes straight to its endpoint: each port has one, so Starlette's router
    and middleware would only pass it on (a fifth of the check port's CPU). The lifespan, the admin
    port and any other socket (a unix socket, a test's server) go through the Starlette
    application; an endpoint's exception is the server protocol's 500 (gateway/http/server.py), as
    Starlette's would be."""

    def __init__(self, app: Starlette, by_port: dict[int, ASGIApp]) -> None:
        self.app = app
        self.by_port = by_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if server is not None and scope["type"] == "http":
            door = self.by_port.get(server[1])
            if door is not None:
                await door(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    """Routes a request to `app` when it arrived on `port` (the admin socket):
    they share the process with the proxy, never the port."""

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


async def _internal_error(request: StarletteRequest, exc: Exception) -> Response:
    status, headers, body = problem(500, "the gateway failed to handle the request")
    return Response(body, status, headers={k.decode(): v.decode() for k, v in headers})
