"""Prometheus metrics. With several workers each writes its own files under
PROMETHEUS_MULTIPROC_DIR (set by the supervisor before workers start) and /metrics sums them.

The request path counts in process-local ints that are flushed to Prometheus every second and
before this worker renders /metrics, so another worker's last second may not be in a scrape yet.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from gateway.settings import metrics_dir

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

REQUESTS = Counter(
    "gateway_requests_total",
    "Every request once, by route (empty: none took it), how it ended (admitted, refused, "
    "failed_open: Redis down, forwarded unlimited, failed_closed: Redis down, 503, bad_request, "
    "client_gone, unknown_key: an API key's 401, no_route, method_not_allowed) and who decided (redis; "
    "memory: a refusal Redis gave, answered again from the worker's memory; none).",
    ["route", "outcome", "decided_by"],
)
RULE_DECISIONS = Counter(
    "gateway_rule_decisions_total",
    "Per rule: admitted (the request was admitted and counted), refused (this rule refused it, "
    "decided_by redis or memory), shadow_refused (a shadow rule would have refused).",
    ["route", "rule", "outcome", "decided_by"],
)
SETTLEMENTS = Counter(
    "gateway_settlements_total",
    "Units charged (count_on, cost: response_header) or given back (refund_on) after the answer, "
    "by route, rule and kind (charge, refund): calls Redis took.",
    ["route", "rule", "kind"],
)
SETTLE_FAILURES = Counter(
    "gateway_settle_failures_total",
    "Charges and refunds after the answer that Redis could not take (unavailable): lost, by route, "
    "rule and kind.",
    ["route", "rule", "kind"],
)
LEASE_FAILURES = Counter(
    "gateway_lease_failures_total",
    "Concurrency slots Redis could not give back (release: freed when their lease runs out) or renew.",
    ["route", "rule", "kind"],
)
RULE_LIMIT = Gauge(
    "gateway_rule_limit",
    "Each rule's configured quota: its limit, or its burst for token_bucket, gcra and leaky_bucket "
    "(divide a rule's admitted rate by it to graph utilisation).",
    ["route", "rule", "algorithm"],
    multiprocess_mode="max",
)
RULE_WINDOW = Gauge(
    "gateway_rule_window_seconds",
    "Each rule's window: the time its quota refills in (0: never, a quota without period).",
    ["route", "rule"],
    multiprocess_mode="max",
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
BREAKER_OPEN = Counter(
    "gateway_redis_breaker_open_seconds_total",
    "Seconds the Redis circuit breaker spent open (limits not applied: routes followed their "
    "failure_mode), summed over workers and failure domains; it grows while the breaker is open.",
)
RLS_CALLS = Counter(
    "gateway_rls_calls_total",
    "Envoy rate limit service calls answered, by result: ok, over_limit, no_domain (no such domain: OK "
    "without limits), unavailable (Redis), invalid (a malformed call: INVALID_ARGUMENT and the like).",
    ["result"],
)
UPSTREAM_LATENCY = Histogram(
    "gateway_upstream_latency_seconds",
    "Time from sending a request upstream to its response headers, by upstream.",
    ["upstream"],
    buckets=LATENCY_BUCKETS,
)
UPSTREAM_ERRORS = Counter(
    "gateway_upstream_errors_total",
    "Upstream failures by upstream and kind (unavailable -> 502, timeout -> 504, aborted, cost: no declared cost "
    "that can be read).",
    ["upstream", "kind"],
)
PROTECT_LIMIT = Gauge(
    "gateway_protect_limit",
    "protect: the adaptive limit on requests in flight to an upstream (route: the route with a protect: of its "
    "own, * for the upstream's), summed over workers (each holds its own).",
    ["upstream", "route"],
    multiprocess_mode="livesum",
)
PROTECT_QUEUED = Gauge(
    "gateway_protect_queued",
    "protect: requests waiting for a place in the in-flight limit (a priority's queue:), by priority.",
    ["upstream", "route", "priority"],
    multiprocess_mode="livesum",
)
PROTECT_FLEET_LIMIT = Gauge(
    "gateway_protect_fleet_limit",
    "protect: scope fleet: the one limit on requests in flight to an upstream that every gateway sharing the "
    "Redis holds together, as this gateway's workers last saw it.",
    ["upstream", "route"],
    multiprocess_mode="max",
)
PROTECT_ANSWER_TIME = Gauge(
    "gateway_protect_answer_time_seconds",
    "protect: the upstream's answer time at the configured percentile, as the limit's last window saw it "
    "(the slowest worker's).",
    ["upstream", "route"],
    multiprocess_mode="max",
)
PROTECT_SHED = Counter(
    "gateway_protect_shed_total",
    "protect: requests refused (503) because the upstream was at its limit, by priority.",
    ["upstream", "route", "priority"],
)
RELOADS = Counter(
    "gateway_config_reloads_total", "Configuration reloads by result (ok, error).", ["result"]
)
CONFIG_INFO = Gauge(
    "gateway_config_routes", "Routes in the configuration in force.", multiprocess_mode="max"
)


def describe_rules(routes: Iterable[Any]) -> None:
    """The configured limits as gauges (at start-up and after each reload). With several workers
    prometheus_client cannot drop a label set from the files the others read (it warns, and does
    nothing): a rule reloaded away keeps its last values there until the gateway restarts."""
    if not metrics_dir():
        RULE_LIMIT.clear()
        RULE_WINDOW.clear()
    for route in routes:
        for rule in route.limits:
            RULE_LIMIT.labels(route.name, rule.name, str(rule.algorithm)).set(rule.quota_size)
            RULE_WINDOW.labels(route.name, rule.name).set(rule.policy_window)


def render() -> tuple[bytes, str]:
    """The exposition text, summed over all workers when running multi-process."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY

    flush()
    directory = metrics_dir()
    registry: Any = REGISTRY
    if directory:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_worker_dead(pid: int) -> None:
    directory = metrics_dir()
    if directory:
        multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


class _LocalCounter:
    """Counts in a plain int on the request path; `flush()` hands the total to Prometheus."""

    __slots__ = ("child", "pending")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.pending = 0

    def inc(self, amount: int = 1) -> None:
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            self.child.inc(self.pending)
            self.pending = 0


class _LocalHistogram:
    """Buckets in a plain list on the request path; `flush()` adds them to the Prometheus child
    (its `_buckets`/`_sum` values: prometheus_client has no public bulk observe)."""

    __slots__ = ("bounds", "child", "counts", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds = [*LATENCY_BUCKETS, float("inf")]
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        if not any(self.counts):
            return
        for i, count in enumerate(self.counts):
            if count:
                self.child._buckets[i].inc(count)
                self.counts[i] = 0
        self.child._sum.inc(self.total)
        self.total = 0.0


_LOCALS: list[_LocalCounter | _LocalHistogram] = []


def _local(metric: Any, kind: type[_LocalCounter] | type[_LocalHistogram], size: int) -> Any:
    @functools.lru_cache(maxsize=size)
    def child(*labels: str) -> _LocalCounter | _LocalHistogram:
        made = kind(metric.labels(*labels))
        _LOCALS.append(made)
        return made

    return child


def flush() -> None:
    """Move what the request path counted into Prometheus (every second, and before /metrics)."""
    for local in _LOCALS:
        local.flush()


# The request path counts locally: with several workers every Prometheus increment is a locked
# write to a shared file, which cost more than the rest of a decision. Label values come from the
# config (route and rule names) or small fixed sets (outcomes, status codes): the caches stay small.
requests = _local(REQUESTS, _LocalCounter, 4096)
rule_decisions = _local(RULE_DECISIONS, _LocalCounter, 4096)
responses = _local(RESPONSES, _LocalCounter, 4096)
settlements = _local(SETTLEMENTS, _LocalCounter, 4096)
settle_failures = _local(SETTLE_FAILURES, _LocalCounter, 4096)
lease_failures = _local(LEASE_FAILURES, _LocalCounter, 4096)
redis_latency = _local(REDIS_LATENCY, _LocalHistogram, 8)
upstream_latency = _local(UPSTREAM_LATENCY, _LocalHistogram, 1024)
upstream_errors = _local(UPSTREAM_ERRORS, _LocalCounter, 1024)
protect_shed = _local(PROTECT_SHED, _LocalCounter, 1024)
rls_calls = _local(RLS_CALLS, _LocalCounter, 64)
