"""/metrics after known traffic, summed over two workers: exact counts."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)


def samples(gateway: GatewayProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(gateway.admin_url + "/metrics").text.splitlines():
        if line.startswith("gateway_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _shows(gateway: GatewayProcess, expected: Mapping[str, float]) -> None:
    """Wait until /metrics shows every expected sample (workers flush now and then); else fail with
    the ones that differ."""

    def matches() -> bool:
        seen = samples(gateway)
        return all(seen.get(name) == value for name, value in expected.items())

    try:
        wait_until(matches, timeout=5, interval=0.2)
    except TimeoutError:
        seen = samples(gateway)
        raise AssertionError({k: (seen.get(k), v) for k, v in expected.items() if seen.get(k) != v}) from None


def test_counts_after_known_traffic(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    config = f"""
    version: 1
    redis: {{key_prefix: m{uuid.uuid4().hex[:6]}}}
    upstreams:
      up: {{url: "{upstream.url}"}}
      dead: {{url: "http://127.0.0.1:{free_port()}", connect_timeout: 500ms}}
    routes:
      - name: sale
        match: {{path: /echo/sale}}
        upstream: up
        limits:
          - {{name: stock, by: [], algorithm: quota, limit: 7}}
          - {{name: watch, by: [], algorithm: fixed_window, limit: 4, window: 1h, shadow: true}}
      - name: gone
        match: {{path: /gone}}
        upstream: dead
    """
    gateway = GatewayProcess(config, tmp_path, redis_url=redis_proc.url, workers=2)
    gateway.start()
    try:
        statuses = [httpx.get(gateway.url + "/echo/sale").status_code for _ in range(10)]
        assert statuses == [200] * 7 + [429] * 3
        assert httpx.get(gateway.url + "/gone").status_code == 502
        expected = {
            'gateway_requests_total{decided_by="redis",outcome="admitted",route="sale"}': 7,
            'gateway_requests_total{decided_by="redis",outcome="refused",route="sale"}': 3,
            'gateway_requests_total{decided_by="none",outcome="admitted",route="gone"}': 1,
            'gateway_rule_decisions_total{decided_by="redis",outcome="admitted",route="sale",rule="stock"}': 7,
            'gateway_rule_decisions_total{decided_by="redis",outcome="refused",route="sale",rule="stock"}': 3,
            'gateway_rule_decisions_total{decided_by="redis",outcome="admitted",route="sale",rule="watch"}': 4,
            'gateway_rule_decisions_total{decided_by="redis",outcome="shadow_refused",route="sale",rule="watch"}': 6,
            'gateway_rule_limit{algorithm="quota",route="sale",rule="stock"}': 7,
            'gateway_rule_limit{algorithm="fixed_window",route="sale",rule="watch"}': 4,
            'gateway_rule_window_seconds{route="sale",rule="stock"}': 0,
            'gateway_rule_window_seconds{route="sale",rule="watch"}': 3600,
            'gateway_responses_total{route="sale",status="200"}': 7,
            'gateway_responses_total{route="sale",status="429"}': 3,
            'gateway_responses_total{route="gone",status="502"}': 1,
            'gateway_upstream_errors_total{kind="unavailable",upstream="dead"}': 1,
            'gateway_redis_latency_seconds_count{result="ok"}': 10,
            'gateway_upstream_latency_seconds_count{upstream="up"}': 7,
            "gateway_redis_breaker_state": 0,
            "gateway_config_routes": 2,
        }

        _shows(gateway, expected)
    finally:
        assert gateway.stop() == 0


def test_every_request_is_counted_once_unknown_keys_and_unrouted_ones_included(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    config = f"""
    version: 1
    redis: {{key_prefix: u{uuid.uuid4().hex[:6]}}}
    keys: {{source: "header:X-Api-Key", plans: [free]}}
    upstreams: {{up: {{url: "{upstream.url}"}}}}
    routes:
      - name: api
        match: {{path: /echo/api, methods: [GET]}}
        upstream: up
    """
    # one worker: once it has read the key, every request after it sees the key (a second would read it
    # within a second, and a request it took meanwhile would be one more 401)
    gateway = GatewayProcess(config, tmp_path, redis_url=redis_proc.url, workers=1)
    gateway.start()
    try:
        with httpx.Client(base_url=gateway.admin_url) as admin:
            assert admin.put("/keys", params={"key": "good"}, json={"plan": "free"}).status_code == 200
        early: list[int] = []  # 401s until this worker has read the key: unknown_key too

        def admitted() -> bool:
            early.append(httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": "good"}).status_code)
            return early[-1] == 200

        wait_until(admitted, timeout=2.0)
        unknown = early.count(401)
        invented = [httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": f"stuffed-{n}"}).status_code
                    for n in range(3)]
        assert invented == [401] * 3
        assert httpx.get(gateway.url + "/echo/api").status_code == 401  # no key at all
        good = {"X-Api-Key": "good"}
        assert httpx.get(gateway.url + "/nowhere", headers=good).status_code == 404
        assert httpx.post(gateway.url + "/echo/api", headers=good).status_code == 405
        expected = {
            'gateway_requests_total{decided_by="none",outcome="unknown_key",route=""}': 4 + unknown,
            'gateway_requests_total{decided_by="none",outcome="no_route",route=""}': 1,
            'gateway_requests_total{decided_by="none",outcome="method_not_allowed",route=""}': 1,
            'gateway_responses_total{route="",status="401"}': 4 + unknown,
            'gateway_responses_total{route="",status="404"}': 1,
        }

        _shows(gateway, expected)
        def total() -> float:  # each worker flushes its counts now and then: the admitted one may come last
            return sum(v for k, v in samples(gateway).items() if k.startswith("gateway_requests_total{"))

        with contextlib.suppress(TimeoutError):  # the assertion below says what was counted
            wait_until(lambda: total() >= len(early) + 6, timeout=5, interval=0.2)
        assert total() == len(early) + 6  # every request once
    finally:
        assert gateway.stop() == 0
