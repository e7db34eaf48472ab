"""Whether the gateway is alive and ready, its metrics, and a reload on the admin port.

    GET  /healthz   alive (200); the body says whether Redis answers a PING and this worker's breaker state
    GET  /readyz    config loaded and serving (200); never asks Redis
    GET  /metrics   Prometheus text
    POST /reload    validate routes.yaml and swap it in (every worker's, under `gateway serve`)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import metrics, reload_log
from gateway.admin.common import (
    AdminControl,
    control_of,
    problem_response,
    write_refusal,
)
from gateway.config import load_config
from gateway.errors import ConfigError, RedisUnavailable
from gateway.settings import supervised

log = logging.getLogger("gateway.admin")


RELOAD_WAIT = 5.0  # seconds for the supervisor to pass a POST /reload on to this worker


async def healthz(request: Request) -> Response:
    control = control_of(request)
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
    control = control_of(request)
    runtime = control.runtime
    if runtime is None or not control.ready:
        return problem_response(503, "configuration not loaded yet")
    return JSONResponse({"status": "ready", "routes": len(runtime.config.routes)})


async def metrics_text(request: Request) -> Response:
    data, content_type = metrics.render()
    return Response(data, headers={"content-type": content_type})


async def reload(request: Request) -> Response:
    control = control_of(request)
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


async def _reload_every_worker(control: AdminControl) -> tuple[bool, str]:
    """Validate here, then let the supervisor signal every worker (this one included, so each
    reloads once) and answer with this worker's own outcome."""
    try:
        load_config(control.settings.config_path, decision_only=control.settings.decision_only)
    except ConfigError as exc:
        metrics.RELOADS.labels("error").inc()
        reload_log.note(False, str(exc))
        log.error("reload refused, keeping the current config:\n%s", exc)  # as a SIGHUP's is
        return False, str(exc)
    outcome = control.next_reload()
    os.kill(os.getppid(), signal.SIGHUP)
    return await asyncio.wait_for(outcome, RELOAD_WAIT)
