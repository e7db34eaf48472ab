"""Counting by the answer (issue 22, SPEC §2): failed logins only, the cost the upstream declares,
refunds of a flash sale's stock when the order failed; against a real gateway, Redis and upstream."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}"}}
  dead: {{url: "http://127.0.0.1:{dead}", connect_timeout: 300ms}}
routes:
  - name: login
    match: {{path: /signin, methods: [POST]}}
    upstream: up
    limits:
      - {{name: failures, by: ["header:X-User"], algorithm: fixed_window, limit: 5, window: 15m, count_on: [401]}}
  - name: sale
    match: {{path: "/flaky/{{item}}", methods: [POST]}}
    upstream: up
    limits:
      - {{name: stock, by: ["path:item"], algorithm: quota, limit: 100, refund_on: [5xx]}}
  - name: gone
    match: {{path: "/gone/{{item}}"}}
    upstream: dead
    limits:
      - {{name: stock, by: ["path:item"], algorithm: quota, limit: 2, refund_on: [5xx]}}
      - {{name: pace, by: ["path:item"], algorithm: token_bucket, rate: 1/h, burst: 3, refund_on: [502]}}
  - name: llm
    match: {{path: /tokens}}
    upstream: up
    limits:
      - {{name: tokens, by: ["header:X-User"], algorithm: fixed_window, limit: 100, window: 1h,
          cost: "response_header:X-Tokens"}}
"""


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess) -> Iterator[GatewayProcess]:
    upstream = Upstream()  # its own: the flaky counter starts at zero
    upstream.start()
    prefix = f"a{uuid.uuid4().hex[:8]}"
    text = CONFIG.format(prefix=prefix, upstream=upstream.url, dead=free_port())
    proc = GatewayProcess(text, tmp_path, redis_url=redis_proc.url)
    proc.start()
    proc.prefix = prefix  # type: ignore[attr-defined]
    proc.upstream = upstream  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0
    upstream.stop()
    assert "Traceback" not in proc.log(), proc.log()


def login(client: httpx.Client, user: str, password: str) -> int:
    return client.post("/signin", headers={"X-User": user, "X-Password": password}).status_code


def test_only_failed_logins_count(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url) as client:
        assert [login(client, "alice", "right") for _ in range(10)] == [200] * 10  # successes cost nothing
        assert [login(client, "alice", "wrong") for _ in range(5)] == [401] * 5
        wait_until(lambda: login(client, "alice", "right") == 429, timeout=5)  # the fifth charge has landed
        refused = client.post("/signin", headers={"X-User": "alice", "X-Password": "right"})
        assert refused.json()["rule"] == "failures" and int(refused.headers["retry-after"]) > 0
        assert login(client, "bob", "wrong") == 401  # another user's budget is untouched


def test_racing_failed_logins_pass_the_budget_by_at_most_those_in_flight(gateway: GatewayProcess) -> None:
    in_flight = 20

    def attempt(_: int) -> int:
        with httpx.Client(base_url=gateway.url) as client:
            return client.post("/signin", params={"delay": "0.05"},
                               headers={"X-User": "mallory", "X-Password": "guess"}).status_code

    with ThreadPoolExecutor(in_flight) as pool:
        statuses = list(pool.map(attempt, range(200)))
    admitted = statuses.count(401)
    assert statuses.count(429) == 200 - admitted
    assert 5 <= admitted <= 5 + in_flight, admitted  # the bound docs/algorithms.md states


def test_refunds_exactly_once_a_flash_sale_with_a_flaky_order_service(
        gateway: GatewayProcess, redis_proc: RedisProcess) -> None:
    def order(n: int) -> int:
        with httpx.Client(base_url=gateway.url) as client:
            return client.post("/flaky/sku42", content=b"%d" % n).status_code

    statuses: list[int] = []
    with ThreadPoolExecutor(16) as pool:
        while statuses.count(200) < 100 and len(statuses) < 400:  # buyers keep coming until it is sold
            statuses += pool.map(order, range(16))
    assert statuses.count(200) == 100, statuses
    assert set(statuses) <= {200, 503, 429}
    ok = httpx.get(gateway.upstream.url + "/flaky-ok").json()["ok"]  # type: ignore[attr-defined]
    assert ok == 100  # the order service took exactly 100 orders
    store = redis.Redis.from_url(redis_proc.url)
    key = f"{gateway.prefix}:{{sale}}:stock:sku42"  # type: ignore[attr-defined]
    wait_until(lambda: store.get(key) == b"100", timeout=5)  # every failed order's unit came back, once
    assert httpx.post(gateway.url + "/flaky/sku42").status_code == 429  # and now it is sold out
    store.close()


def test_the_gateways_own_502_gives_the_units_back(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url) as client:
        assert [client.get("/gone/x").status_code for _ in range(6)] == [502] * 6
    admin = httpx.Client(base_url=gateway.admin_url)
    wait_until(lambda: admin.get("/limits/gone/stock", params={"key": "x"}).json()["remaining"] == 2, timeout=5)
    assert admin.get("/limits/gone/pace", params={"key": "x"}).json()["remaining"] == 3  # a bucket refills
    admin.close()


def test_the_upstream_declares_the_cost_and_the_client_never_sees_it(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url, headers={"X-User": "carol"}) as client:
        first = client.get("/tokens", params={"n": "30"})
        assert first.status_code == 200 and "x-tokens" not in first.headers
        for _ in range(3):  # 60, 90, then 120: admitted while the budget was not spent
            assert client.get("/tokens", params={"n": "30"}).status_code == 200
        wait_until(lambda: client.get("/tokens", params={"n": "1"}).status_code == 429, timeout=5)
        assert client.get("/tokens", headers={"X-User": "dave"}, params={"n": "1"}).status_code == 200


def test_a_charge_redis_cannot_take_is_counted_and_named(tmp_path: Path) -> None:
    own = RedisProcess()
    own.start()
    upstream = Upstream()
    upstream.start()
    text = CONFIG.format(prefix=f"a{uuid.uuid4().hex[:8]}", upstream=upstream.url, dead=free_port())
    gateway = GatewayProcess(text, tmp_path, redis_url=own.url)
    gateway.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            failing = pool.submit(httpx.post, gateway.url + "/signin", params={"delay": "0.5"},
                                  headers={"X-User": "gus", "X-Password": "wrong"}, timeout=10)
            time.sleep(0.2)  # admitted (checked) by now; the answer comes at 0.5 s
            assert own.process is not None
            own.process.send_signal(signal.SIGSTOP)
            try:
                assert failing.result().status_code == 401  # the answer never waits for the charge
                wait_until(lambda: 'gateway_settle_failures_total{kind="charge",route="login",rule="failures"} 1.0'
                           in httpx.get(gateway.admin_url + "/metrics").text, timeout=5)
            finally:
                own.process.send_signal(signal.SIGCONT)
    finally:
        assert gateway.stop() == 0
        upstream.stop()
        own.stop()
    assert "route login rule failures lost a charge of 1 after the answer" in gateway.log()
