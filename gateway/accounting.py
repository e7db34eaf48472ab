"""What is recorded of each request the proxy served: its metrics and its access log line."""

from __future__ import annotations

import json
import logging
import time

from starlette.types import Scope

from gateway import metrics
from gateway.config import Config

access_log = logging.getLogger("gateway.access")


def account(config: Config, scope: Scope, request_id: bytes, route: str, outcome: str, rule: str,
            status: int, started: float) -> None:
    """Count one request in the metrics and, when `access_log` is on, write its line."""
    if route:
        metrics.requests(route, outcome).inc()
        metrics.responses(route, str(status)).inc()
    if config.access_log:
        access_log.info(json.dumps({
            "request_id": request_id.decode("latin-1"),
            "method": scope.get("method"),
            "path": scope.get("path", "")[:512],
            "client": (scope.get("client") or ("",))[0],
            "route": route or None,
            "decision": str(outcome),
            "rule": rule or None,
            "status": status,
            "latency_ms": round((time.perf_counter() - started) * 1000, 3),
        }))
