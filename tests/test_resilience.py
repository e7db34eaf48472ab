"""Resilience against real processes: Redis killed, restarted, flushed and paused under load; reload
with a bad then a good file; SIGTERM with requests in flight; the access log. Never a 500."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

CONFIG = """
version: 1
redis: {{timeout: 50ms}}
access_log: true
admin: {{token: "{token}"}}
upstreams: {{up: {{url: "{upstream}", timeout: 5s}}}}
routes:
  - name: open
    match: {{path: /echo/open}}
    upstream: up
    limits: [{{name: g, by: [], algorithm: gcra, rate: 100000/s, burst: 100000}}]
  - name: closed
    match: {{path: /echo/closed}}
    upstream: up
    failure_mode: closed
    limits: [{{name: g, by: [], algorithm: gcra, rate: 100000/s, burst: 100000}}]
  - name: stock
    match: {{path: /echo/stock}}
    upstream: up
    limits: [{{name: q, by: [header:X-Run], algorithm: quota, limit: 2}}]
  - name: slow
    match: {{path: /slow}}
    upstream: up
"""
TOKEN = "s3cret-admin-token"


@pytest.fixture
def redis() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def gateway(tmp_path: Path, redis: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(CONFIG.format(token=TOKEN, upstream=upstream.url), tmp_path, redis_url=redis.url, workers=2)
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


async def load(url: str, paths: list[str], headers: dict[str, str] | None = None) -> list[tuple[int, float]]:
    async def one(client: httpx.AsyncClient, path: str) -> tuple[int, float]:
        started = time.perf_counter()
        response = await client.get(path, headers=headers)
        return response.status_code, time.perf_counter() - started

    async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=20)) as client:
        return await asyncio.gather(*[one(client, p) for p in paths])


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    text = httpx.get(gateway.admin_url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_redis_killed_under_load_follows_each_failure_policy_within_the_timeout(
    gateway: GatewayProcess, redis: RedisProcess
) -> None:
    assert {s for s, _ in asyncio.run(load(gateway.url, ["/echo/open", "/echo/closed"] * 20))} == {200}
    assert redis.process is not None
    redis.process.kill()
    redis.process.wait()
    results = asyncio.run(load(gateway.url, ["/echo/open", "/echo/closed"] * 100))
    open_statuses = [s for i, (s, _) in enumerate(results) if i % 2 == 0]
    closed_statuses = [s for i, (s, _) in enumerate(results) if i % 2 == 1]
    assert set(open_statuses) == {200}
    assert set(closed_statuses) == {503}
    # one at a time, so the time is the gateway's and not a client queue's
    alone = []
    for path in ["/echo/open", "/echo/closed"] * 10:
        started = time.perf_counter()
        assert httpx.get(gateway.url + path).status_code in (200, 503)
        alone.append(time.perf_counter() - started)
    print(f"slowest single request while Redis was dead: {max(alone) * 1000:.1f} ms (redis.timeout 50 ms)")
    assert max(alone) < 0.5
    closed = httpx.get(gateway.url + "/echo/closed")
    assert closed.headers["retry-after"] == "1" and closed.headers["content-type"] == "application/problem+json"
    wait_until(lambda: metric(gateway, "gateway_requests_total", outcome="failed_open") >= 100, timeout=5)
    wait_until(lambda: metric(gateway, "gateway_redis_breaker_state") == 1, timeout=5)


def test_limits_apply_again_after_a_redis_restart(gateway: GatewayProcess, redis: RedisProcess) -> None:
    run = {"X-Run": "before"}
    assert [httpx.get(gateway.url + "/echo/stock", headers=run).status_code for _ in range(3)] == [200, 200, 429]
    redis.restart()  # empty memory, same port
    run = {"X-Run": "after"}

    def refuses_again() -> bool:
        statuses = [httpx.get(gateway.url + "/echo/stock", headers=run).status_code for _ in range(3)]
        assert 500 not in statuses
        return statuses[-1] == 429

    wait_until(refuses_again, timeout=10, interval=0.3)
    wait_until(lambda: metric(gateway, "gateway_redis_breaker_state") == 0, timeout=5)


def test_script_flush_and_a_paused_redis_cost_no_error(gateway: GatewayProcess, redis: RedisProcess) -> None:
    redis.client().script_flush()
    assert {s for s, _ in asyncio.run(load(gateway.url, ["/echo/closed"] * 60))} == {200}
    assert redis.process is not None
    os.kill(redis.process.pid, signal.SIGSTOP)
    try:
        results = asyncio.run(load(gateway.url, ["/echo/open", "/echo/closed"] * 10))
    finally:
        os.kill(redis.process.pid, signal.SIGCONT)
    assert {s for i, (s, _) in enumerate(results) if i % 2 == 0} == {200}
    assert {s for i, (s, _) in enumerate(results) if i % 2 == 1} == {503}
    assert max(t for _, t in results) < 1.0
    wait_until(lambda: httpx.get(gateway.url + "/echo/closed").status_code == 200, timeout=10, interval=0.2)


def test_reload_keeps_the_old_config_on_a_bad_file_and_takes_a_good_one(gateway: GatewayProcess) -> None:
    good = gateway.config_path.read_text()
    assert httpx.post(gateway.admin_url + "/reload").status_code == 401
    gateway.config_path.write_text(good.replace("version: 1", "version: 1\nbogus: true"))
    refused = httpx.post(gateway.admin_url + "/reload", headers={"Authorization": f"Bearer {TOKEN}"})
    assert refused.status_code == 422 and any("bogus" in e for e in refused.json()["errors"])
    time.sleep(1.5)  # the supervisor notices the file too: still refused
    assert httpx.get(gateway.url + "/echo/open").status_code == 200

    renamed = good.replace("match: {path: /echo/open}", "match: {path: /echo/opened}")
    gateway.config_path.write_text(renamed)
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: all(httpx.get(gateway.url + "/echo/opened").status_code == 200 for _ in range(6)), timeout=10)
    assert httpx.get(gateway.url + "/echo/open").status_code == 404
    wait_until(lambda: metric(gateway, "gateway_config_reloads_total", result="error") >= 1, timeout=5)
    wait_until(lambda: metric(gateway, "gateway_config_reloads_total", result="ok") >= 2, timeout=5)


def test_post_reload_takes_a_good_file_in_every_worker_once(
    tmp_path: Path, redis: RedisProcess, upstream: Upstream
) -> None:
    gateway = GatewayProcess(CONFIG.format(token=TOKEN, upstream=upstream.url), tmp_path, redis_url=redis.url,
                             workers=2, env={"GATEWAY_WATCH_INTERVAL": "0"})
    gateway.start()
    try:
        gateway.config_path.write_text(gateway.config_path.read_text().replace(
            "match: {path: /echo/open}", "match: {path: /echo/opened}"))
        assert httpx.get(gateway.url + "/echo/opened").status_code == 404  # the file alone changes nothing
        answer = httpx.post(gateway.admin_url + "/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200 and answer.json()["reloaded"] is True
        wait_until(lambda: metric(gateway, "gateway_config_reloads_total", result="ok") >= 2, timeout=5)
        # each on a new connection, whichever worker takes it
        assert {httpx.get(gateway.url + "/echo/opened").status_code for _ in range(20)} == {200}
        time.sleep(1.5)
        assert metric(gateway, "gateway_config_reloads_total", result="ok") == 2  # once per worker
        assert metric(gateway, "gateway_config_reloads_total", result="error") == 0
    finally:
        assert gateway.stop() == 0


def test_a_reload_asked_while_workers_start_waits_for_them(
    tmp_path: Path, redis: RedisProcess, upstream: Upstream
) -> None:
    gateway = GatewayProcess(CONFIG.format(token=TOKEN, upstream=upstream.url), tmp_path,
                             redis_url=redis.url, workers=2)
    gateway.start(ready=False)
    try:
        hit: set[int] = set()

        def every_worker_signalled() -> bool:
            for pid in gateway.worker_pids():
                if pid not in hit:
                    os.kill(pid, signal.SIGHUP)  # as early as the worker process exists
                    hit.add(pid)
            return len(hit) >= 2

        wait_until(every_worker_signalled, timeout=30, interval=0.001)
        wait_until(gateway.ready, timeout=30)
        wait_until(lambda: metric(gateway, "gateway_config_reloads_total", result="ok") >= 2, timeout=10)
        assert sorted(gateway.worker_pids()) == sorted(hit)
        assert "exited with" not in gateway.log()
    finally:
        assert gateway.stop() == 0


def test_a_worker_replaced_while_the_file_is_bad_starts_on_the_last_good_config(gateway: GatewayProcess) -> None:
    gateway.config_path.write_text("version: 1\nroutes: [oops\n")
    victim, survivor = gateway.worker_pids()
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(set(gateway.worker_pids()) - {victim, survivor}) == 1, timeout=10)
    [replacement] = set(gateway.worker_pids()) - {victim, survivor}
    os.kill(survivor, signal.SIGKILL)  # now only the replacement can answer

    def answered() -> bool:
        try:
            return httpx.get(gateway.url + "/echo/open", timeout=2).status_code == 200
        except httpx.HTTPError:  # still starting: the connection waits in the shared backlog
            return False

    wait_until(answered, timeout=20)
    assert replacement in gateway.worker_pids()
    assert "startup failed" not in gateway.log()


def test_in_flight_requests_finish_on_their_config_and_through_sigterm(
        gateway: GatewayProcess, upstream: Upstream) -> None:
    arrived = upstream.arrived("/slow")
    reloads = metric(gateway, "gateway_config_reloads_total", result="ok")

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            slow = [asyncio.ensure_future(client.get("/slow", params={"delay": "1.5"})) for _ in range(3)]
            await asyncio.to_thread(wait_until, lambda: upstream.arrived("/slow") == arrived + 3, timeout=5)
            gateway.config_path.write_text(gateway.config_path.read_text().replace(
                "match: {path: /slow}", "match: {path: /slower}"))
            gateway.signal(signal.SIGHUP)
            await asyncio.to_thread(  # both workers took the new config
                wait_until, lambda: metric(gateway, "gateway_config_reloads_total", result="ok") >= reloads + 2,
                timeout=5)
            gateway.signal(signal.SIGTERM)
            return [r.status_code for r in await asyncio.gather(*slow)]

    assert asyncio.run(scenario()) == [200, 200, 200]
    assert gateway.process is not None
    assert gateway.process.wait(20) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(gateway.url + "/echo/open")


def test_access_log_has_one_json_line_per_request_and_no_secrets(gateway: GatewayProcess) -> None:
    secret = "Bearer eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXRva2Vu.sig"
    httpx.get(gateway.url + "/echo/open?password=hunter2", headers={"Authorization": secret, "X-Request-Id": "rid-1"})
    httpx.get(gateway.url + "/nowhere")

    def logged() -> list[dict[str, object]]:
        return [json.loads(line) for line in gateway.out_path.read_text().splitlines() if line.startswith("{")]

    wait_until(lambda: len(logged()) >= 2, timeout=5)
    first = next(e for e in logged() if e["request_id"] == "rid-1")
    assert first["route"] == "open" and first["decision"] == "admitted" and first["status"] == 200
    assert first["path"] == "/echo/open" and isinstance(first["latency_ms"], float)
    assert any(e["decision"] == "no_route" and e["status"] == 404 for e in logged())
    everything = gateway.out_path.read_text() + gateway.log()
    for leaked in ("hunter2", "eyJhbGciOiJIUzI1NiJ9", TOKEN):
        assert leaked not in everything
