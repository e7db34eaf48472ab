"""Concurrency leases (issue 21, SPEC §2 `concurrency`): slots taken in the route's one call, held
while a request is in flight and given back exactly once however it ends; a dead gateway's slots
free after their lease. Real gateways, Redis and upstreams."""

from __future__ import annotations

import signal
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from gateway.keys import identity_token
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}", timeout: 30s}}
  dead: {{url: "http://127.0.0.1:{dead}", connect_timeout: 300ms}}
routes:
  - name: work
    match: {{path: /inflight}}
    upstream: up
    limits:
      - {{name: busy, by: ["header:X-User"], algorithm: concurrency, limit: {limit}, lease: {lease}}}
  - name: gone
    match: {{path: /gone}}
    upstream: dead
    limits:
      - {{name: busy, by: ["header:X-User"], algorithm: concurrency, limit: 1}}
"""


@pytest.fixture
def upstream_own() -> Iterator[Upstream]:
    upstream = Upstream()  # its own: the in-flight count starts at zero
    upstream.start()
    yield upstream
    upstream.stop()


def user_token(user: str) -> str:
    """The identity token of an X-User value in a key: a digest (a header's value is never kept as it came)."""
    return identity_token([user.encode()], readable=False)


def start(tmp_path: Path, redis_url: str, upstream: Upstream, prefix: str, limit: int = 2,
          lease: str = "60s") -> GatewayProcess:
    text = CONFIG.format(prefix=prefix, upstream=upstream.url, dead=free_port(), limit=limit, lease=lease)
    workdir = tmp_path / uuid.uuid4().hex[:6]
    workdir.mkdir()
    proc = GatewayProcess(text, workdir, redis_url=redis_url)
    proc.start()
    return proc


def slots(redis_url: str, key: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.zcard(key))
    finally:
        client.close()


def test_slots_are_held_while_in_flight_and_given_back(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    gateway = start(tmp_path, redis_proc.url, upstream_own, prefix)
    key = f"{prefix}:{{work}}:busy:{user_token('alice')}"
    try:
        def call(user: str, delay: float) -> httpx.Response:
            return httpx.get(gateway.url + "/inflight", params={"delay": delay}, headers={"X-User": user}, timeout=10)

        with ThreadPoolExecutor(3) as pool:
            slow = [pool.submit(call, "alice", 1.5) for _ in range(2)]
            wait_until(lambda: slots(redis_proc.url, key) == 2, timeout=5)
            third = call("alice", 0)
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert third.json()["rule"] == "busy" and third.headers["ratelimit"] == '"busy";r=0;t=1'
            assert call("bob", 0).status_code == 200  # another identity's slots
            assert [f.result().status_code for f in slow] == [200, 200]
        wait_until(lambda: slots(redis_proc.url, key) == 0, timeout=5)  # given back when sent in full
        admitted = call("alice", 0)
        assert admitted.status_code == 200 and admitted.headers["ratelimit"] == '"busy";r=1;t=1'
        # an upstream that fails gives its slot back too
        assert [httpx.get(gateway.url + "/gone", headers={"X-User": "carol"}).status_code for _ in range(3)] \
            == [502] * 3
        wait_until(lambda: slots(redis_proc.url, f"{prefix}:{{gone}}:busy:{user_token('carol')}") == 0, timeout=5)
        # a client that leaves mid-request: its slot comes back once the request ends
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.sendall(b"GET /inflight?delay=0.5 HTTP/1.1\r\nHost: a\r\nX-User: dave\r\n\r\n")
            wait_until(lambda: slots(redis_proc.url, f"{prefix}:{{work}}:busy:{user_token('dave')}") == 1, timeout=5)
        wait_until(lambda: slots(redis_proc.url, f"{prefix}:{{work}}:busy:{user_token('dave')}") == 0, timeout=5)
    finally:
        assert gateway.stop() == 0


def test_a_gateway_killed_holding_slots_loses_them_after_the_lease(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    doomed = start(tmp_path, redis_proc.url, upstream_own, prefix, lease="2s")
    other = start(tmp_path, redis_proc.url, upstream_own, prefix, lease="2s")
    key = f"{prefix}:{{work}}:busy:{user_token('erin')}"
    pool = ThreadPoolExecutor(2)
    try:
        for _ in range(2):
            pool.submit(httpx.get, doomed.url + "/inflight", params={"delay": 8}, headers={"X-User": "erin"},
                        timeout=60)
        wait_until(lambda: slots(redis_proc.url, key) == 2, timeout=5)
        assert doomed.process is not None
        doomed.process.send_signal(signal.SIGKILL)  # the supervisor; its worker dies with it (issue 23)
        killed = time.monotonic()
        refused = httpx.get(other.url + "/inflight", params={"delay": 0}, headers={"X-User": "erin"})
        assert refused.status_code == 429  # the dead gateway's slots still count...
        wait_until(lambda: httpx.get(other.url + "/inflight", params={"delay": 0},
                                     headers={"X-User": "erin"}).status_code == 200, timeout=10)
        assert time.monotonic() - killed < within(2 + 3)  # ...until their lease runs out (renewed every 2/3 s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        doomed.stop()
        assert other.stop() == 0


def test_racing_gateways_never_let_more_than_the_limit_in(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    gateways: list[GatewayProcess] = []
    try:
        for _ in range(8):
            gateways.append(start(tmp_path, redis_proc.url, upstream_own, prefix, limit=10))

        def call(n: int) -> int:
            gateway = gateways[n % len(gateways)]
            return httpx.get(gateway.url + "/inflight", params={"delay": 0.3}, headers={"X-User": "all"},
                             timeout=30).status_code

        with ThreadPoolExecutor(64) as pool:
            statuses = list(pool.map(call, range(200)))
        assert statuses.count(200) >= 10 and set(statuses) <= {200, 429}
        most = httpx.get(upstream_own.url + "/inflight-max").json()["most"]
        assert 1 <= most <= 10, most  # the upstream never saw more than the limit at once
        wait_until(lambda: slots(redis_proc.url, f"{prefix}:{{work}}:busy:{user_token('all')}") == 0, timeout=5)
    finally:
        codes = [g.stop() for g in gateways]
        assert codes == [0] * len(gateways)


def test_a_redis_outage_during_a_give_back_never_holds_a_slot_past_its_lease(
        tmp_path: Path, upstream_own: Upstream) -> None:
    own = RedisProcess()
    own.start()
    prefix = f"c{uuid.uuid4().hex[:8]}"
    gateway = start(tmp_path, own.url, upstream_own, prefix, limit=1, lease="3s")
    key = f"{prefix}:{{work}}:busy:{user_token('frank')}"
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.get, gateway.url + "/inflight", params={"delay": 0.6},
                                  headers={"X-User": "frank"}, timeout=10)
            wait_until(lambda: slots(own.url, key) == 1, timeout=5)
            assert own.process is not None
            own.process.send_signal(signal.SIGSTOP)  # Redis hangs while the answer comes back
            try:
                assert pending.result().status_code == 200
                time.sleep(1.5)  # the give-back timed out (500ms), and its retry a second later too
            finally:
                own.process.send_signal(signal.SIGCONT)
        failures = httpx.get(gateway.admin_url + "/metrics").text
        assert 'gateway_lease_failures_total{kind="release",route="work",rule="busy"}' in failures
        wait_until(lambda: slots(own.url, key) == 0 or httpx.get(
            gateway.url + "/inflight", params={"delay": 0}, headers={"X-User": "frank"}).status_code == 200,
            timeout=6)  # given back by the retry, or freed when its lease ran out: never held for good
    finally:
        assert gateway.stop() == 0
        own.stop()
