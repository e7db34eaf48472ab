"""The console: `GET /` on the admin port, a page for people (gateway/admin/console/: HTML, JS, CSS, no
build step, nothing from another origin).

    GET /                  the page (Content-Security-Policy: this origin only)
    GET /console/state     what no other endpoint says: every route's and rule's decisions so far,
                           all workers together (counters: the page draws their rate), Redis's
                           decision latency, the breaker (worst over workers), reloads, key plans
    GET /console/*.js|css  the page's script and style

The page reads the JSON endpoints (/limits, /top, /overrides, /keys, /healthz) and writes through
them, with the admin token the operator types in sent as `Authorization: Bearer`, never a cookie:
every write meets the same checks as the API's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway import metrics, reload_log
from gateway.admin.common import AdminControl, problem_response
from gateway.breaker import BreakerState
from gateway.settings import metrics_dir

STATIC = Path(__file__).with_name("console")
# four small files, read once: the page works offline and never touches the disk per request
FILES = {path.name: path.read_bytes() for path in STATIC.iterdir() if path.suffix in (".html", ".js", ".css", ".svg")}
TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css", "svg": "image/svg+xml"}
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
          "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {
    "content-security-policy": POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def console_routes(control: AdminControl) -> list[BaseRoute]:
    async def page(request: Request) -> Response:
        return Response(FILES["index.html"], media_type="text/html", headers=HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in FILES or name == "index.html":
            return problem_response(404, f"no admin endpoint {request.url.path[:200]}")
        return Response(FILES[name], media_type=TYPES[name.rpartition(".")[2]], headers=HEADERS)

    async def state(request: Request) -> Response:
        runtime = control.runtime
        keys = runtime.config.keys if runtime is not None else None
        return JSONResponse(decisions() | {
            "at": time.time(),
            "last_reload": reload_log.last(),
            "plans": list(keys.plans) if keys is not None else None,
        }, headers={"cache-control": "no-store"})

    return [
        Route("/", page, methods=["GET"]),
        Route("/console/state", state, methods=["GET"]),
        Route("/console/{name}", asset, methods=["GET"]),
    ]


def decisions() -> dict[str, Any]:
    """The counters of every worker, summed: requests by route and outcome, decisions by route, rule
    and outcome, Redis decision calls and their time, reloads, and the worst breaker state."""
    routes: dict[str, dict[str, float]] = {}
    rules: dict[str, dict[str, dict[str, float]]] = {}
    redis = {"calls": 0.0, "seconds": 0.0}
    reloads: dict[str, float] = {}
    breaker = 0.0
    for family in _registry().collect():
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "gateway_requests_total":
                outcomes = routes.setdefault(labels["route"], {})
                outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0.0) + value
            elif name == "gateway_rule_decisions_total":
                outcomes = rules.setdefault(labels["route"], {}).setdefault(labels["rule"], {})
                outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0.0) + value
            elif name == "gateway_redis_latency_seconds_count" and labels.get("result") == "ok":
                redis["calls"] += value
            elif name == "gateway_redis_latency_seconds_sum" and labels.get("result") == "ok":
                redis["seconds"] += value
            elif name == "gateway_config_reloads_total":
                reloads[labels["result"]] = reloads.get(labels["result"], 0.0) + value
            elif name == "gateway_redis_breaker_state":
                breaker = max(breaker, value)
    return {"routes": routes, "rules": rules, "redis": redis, "reloads": reloads,
            "breaker": BreakerState(int(breaker)).name.lower()}


def _registry() -> Any:
    metrics.flush()  # this worker's last second; the others flush theirs every second
    directory = metrics_dir()
    if not directory:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry
