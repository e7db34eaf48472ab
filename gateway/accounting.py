"""What is recorded of each request the proxy served: its metrics, its access log line, and its
refusal among the identities refused most (gateway/top.py)."""

from __future__ import annotations

import json
import logging
import time

from starlette.types import Scope

from gateway import metrics
from gateway.config import Config
from gateway.outcome import Admit, Answer, RequestOutcome
from gateway.request_id import new_request_id
from gateway.top import TopRefused

access_log = logging.getLogger("gateway.access")


class Accounting:
    def __init__(self, top: TopRefused) -> None:
        self.top = top

    def account(self, config: Config, scope: Scope, request_id: bytes, result: Admit | Answer, status: int,
                started: float) -> None:
        """Count one request in the metrics and the top refused, and write its access log line
        (`request_id` b"": one is made for it)."""
        route = result.route
        outcome, decided_by = result.outcome, result.decided_by
        rule, identity = (result.rule, result.identity) if isinstance(result, Answer) else ("", "")
        # every request once, those no route took (route="": 404, 405, an unknown API key's 401) too
        metrics.requests(route, str(outcome), str(decided_by)).inc()  # plain strs: an Enum hashes in Python
        metrics.responses(route, str(status)).inc()
        if route and outcome is RequestOutcome.REFUSED:
            self.top.record(route, rule, identity, result.consumer)
        if config.access_log:
            access_log.info(json.dumps({
                "request_id": (request_id or new_request_id()).decode("latin-1"),
                "method": scope.get("method"),
                "path": scope.get("path", "")[:512],
                "client": (scope.get("client") or ("",))[0],
                "route": route or None,
                "decision": str(outcome),
                "decided_by": str(decided_by),
                "rule": rule or None,
                "identity": identity or None,
                "consumer": result.consumer or None,
                "status": status,
                "latency_ms": round((time.perf_counter() - started) * 1000, 3),
            }))
