"""Prometheus metrics. With several workers each writes its own files under
PROMETHEUS_MULTIPROC_DIR (set by the supervisor before workers start) and /metrics sums them."""

from __future__ import annotations

import functools
import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

REQUESTS = Counter(
    "gateway_requests_total",
    "Requests by route and how they ended: admitted, refused, failed_open (Redis down, forwarded "
    "unlimited), failed_closed (Redis down, 503), bad_request, no_route.",
    ["route", "outcome"],
)
RULE_DECISIONS = Counter(
    "gateway_rule_decisions_total",
    "Per rule: admitted (the request was admitted and counted), refused (this rule refused it), "
    "shadow_refused (a shadow rule would have refused).",
    ["route", "rule", "outcome"],
)
RESPONSES = Counter(
    "gateway_responses_total", "Responses sent, by route and status code.", ["route", "status"]
)
REDIS_LATENCY = Histogram(
    "gateway_redis_latency_seconds",
    "Time for one decision call to Redis, by result (ok, error).",
    ["result"],
    buckets=LATENCY_BUCKETS,
)
REDIS_ERRORS = Counter(
    "gateway_redis_errors_total",
    "Decisions that Redis could not make: timeout, connection lost, breaker open, error reply.",
    ["kind"],
)
BREAKER = Gauge(
    "gateway_redis_breaker_state",
    "Redis circuit breaker: 0 closed (calling Redis), 1 open (not calling), 2 half-open (probing). "
    "Worst over workers.",
    multiprocess_mode="max",
)
UPSTREAM_LATENCY = Histogram(
    "gateway_upstream_latency_seconds",
    "Time from sending a request upstream to its response headers, by upstream.",
    ["upstream"],
    buckets=LATENCY_BUCKETS,
)
UPSTREAM_ERRORS = Counter(
    "gateway_upstream_errors_total",
    "Upstream failures by upstream and kind (unavailable -> 502, timeout -> 504, aborted).",
    ["upstream", "kind"],
)
RELOADS = Counter(
    "gateway_config_reloads_total", "Configuration reloads by result (ok, error).", ["result"]
)
CONFIG_INFO = Gauge(
    "gateway_config_routes", "Routes in the configuration in force.", multiprocess_mode="max"
)


def render() -> tuple[bytes, str]:
    """The exposition text, summed over all workers when running multi-process."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY

    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    registry: Any = REGISTRY
    if directory:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_worker_dead(pid: int) -> None:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


# Labelled children, resolved once: `labels()` validates and locks on every call, which costs more
# than the increment itself on the request path. Label values come from the config (route and rule
# names) or small fixed sets (outcomes, status codes), so the caches stay small.
requests = functools.lru_cache(maxsize=4096)(REQUESTS.labels)
rule_decisions = functools.lru_cache(maxsize=4096)(RULE_DECISIONS.labels)
responses = functools.lru_cache(maxsize=4096)(RESPONSES.labels)
redis_latency = functools.lru_cache(maxsize=8)(REDIS_LATENCY.labels)
upstream_latency = functools.lru_cache(maxsize=1024)(UPSTREAM_LATENCY.labels)
upstream_errors = functools.lru_cache(maxsize=1024)(UPSTREAM_ERRORS.labels)
