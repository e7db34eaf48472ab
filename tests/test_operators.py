"""What an operator and a newcomer meet (issue 11), end to end against real processes: a Redis outage
is not a total outage, the admin port is closed by default, the repository's example teaches the
right thing, the embedded Redis keeps its state with --data-dir, and the small things of the CLI."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisClock, RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
REPO_ROUTES = (ROOT / "routes.yaml").read_text()
ORDER = {"X-User-Id": "alice", "Content-Type": "application/json"}


def problem(response: httpx.Response) -> dict[str, object]:
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, object] = response.json()
    assert body["status"] == response.status_code
    return body


def metric(gateway: GatewayProcess, name: str) -> float:
    for line in httpx.get(gateway.admin_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def local_non_loopback_address() -> str:
    """An address of this machine that is not loopback (the one it would use to leave the box)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.250", 9))  # no packet is sent: this only picks the outgoing interface
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), "this machine has no non-loopback IPv4 address to test from"
    return address


# --- a Redis outage is not a total outage --------------------------------------------------------

OUTAGE = """
version: 1
redis: {{timeout: 50ms}}
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
"""


def test_redis_killed_while_traffic_flows_keeps_the_pod_ready(tmp_path: Path, upstream: Upstream) -> None:
    redis = RedisProcess()
    redis.start()
    gateway = GatewayProcess(OUTAGE.format(upstream=upstream.url), tmp_path, redis_url=redis.url)
    gateway.start()
    answers: list[tuple[float, float, str, int, str | None]] = []  # (sent, answered, path, status, Retry-After)
    readiness: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=gateway.url, timeout=5) as client:
            while not stop.is_set():
                for path in ("/echo/open", "/echo/closed"):
                    sent = time.monotonic()
                    response = client.get(path)
                    answers.append((sent, time.monotonic(), path, response.status_code,
                                    response.headers.get("retry-after")))

    def probe() -> None:
        with httpx.Client(base_url=gateway.admin_url, timeout=5) as client:
            while not stop.is_set():
                readiness.append(client.get("/readyz").status_code)
                time.sleep(0.05)

    threads = [threading.Thread(target=traffic), threading.Thread(target=traffic), threading.Thread(target=probe)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        assert redis.process is not None
        redis.process.kill()
        killed = time.monotonic()
        time.sleep(2.5)
        stop.set()
        for thread in threads:
            thread.join(10)

        before = [a for a in answers if a[1] < killed]
        after = [a for a in answers if a[0] > killed + 0.1]  # the calls in flight at the kill may go either way
        assert before and {status for _, _, _, status, _ in before} == {200}
        assert {status for _, _, path, status, _ in after if path == "/echo/open"} == {200}, "fail-open forwards"
        closed = [(status, retry) for _, _, path, status, retry in after if path == "/echo/closed"]
        assert closed and set(closed) == {(503, "1")}, "fail-closed answers 503 with Retry-After"
        print(f"{len(after)} requests after the kill; /readyz polled {len(readiness)} times")
        assert readiness and set(readiness) == {200}, "readiness never follows Redis"

        health = httpx.get(gateway.admin_url + "/healthz")
        assert health.status_code == 200
        assert health.json()["redis"]["answers"] is False and health.json()["breaker"] in ("open", "half_open")
        wait_until(lambda: metric(gateway, "gateway_redis_breaker_state") >= 1, timeout=5)
        assert httpx.get(gateway.url + "/echo/closed").status_code == 503

        redis.restart()  # same port, empty memory: everything recovers by itself
        wait_until(lambda: httpx.get(gateway.url + "/echo/closed").status_code == 200, timeout=10, interval=0.2)
        wait_until(lambda: httpx.get(gateway.admin_url + "/healthz").json()["breaker"] == "closed", timeout=5)
        healthy = httpx.get(gateway.admin_url + "/healthz").json()
        assert healthy["redis"]["answers"] is True and healthy["ready"] is True
        assert "Traceback" not in gateway.log(), gateway.log()
    finally:
        stop.set()
        assert gateway.stop() == 0
        redis.stop()


# --- the admin port is closed by default ----------------------------------------------------------

ADMIN = """
version: 1
admin: {{token: "{token}"}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: stock
    match: {{path: /echo/stock}}
    upstream: up
    limits: [{{name: q, by: [header:X-Item], algorithm: quota, limit: 1}}]
"""


def test_admin_listens_on_loopback_unless_told_otherwise(tmp_path: Path, redis_proc: RedisProcess,
                                                         upstream: Upstream) -> None:
    outside = local_non_loopback_address()
    gateway = GatewayProcess(ADMIN.format(token="", upstream=upstream.url), tmp_path, redis_url=redis_proc.url,
                             args=("--host", "0.0.0.0"))
    gateway.start()
    try:
        assert httpx.get(f"http://{outside}:{gateway.port}/echo/stock", headers={"X-Item": "a"}).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{outside}:{gateway.admin_port}/healthz")
        assert httpx.get(gateway.admin_url + "/healthz").status_code == 200
        missing = httpx.get(gateway.url + "/nowhere")  # no route knows the path under any method
        assert missing.status_code == 404 and "GET /nowhere" in str(problem(missing)["detail"])
    finally:
        assert gateway.stop() == 0


def test_admin_writes_without_a_token_come_from_loopback_only(tmp_path: Path, redis_proc: RedisProcess,
                                                              upstream: Upstream) -> None:
    outside = local_non_loopback_address()
    # no file watch: the token written below must take effect by the POST /reload, not by a watch
    # that may see the file first (then the tokenless POST is a 401)
    gateway = GatewayProcess(ADMIN.format(token="", upstream=upstream.url), tmp_path, redis_url=redis_proc.url,
                             env={"GATEWAY_ADMIN_HOST": "0.0.0.0", "GATEWAY_WATCH_INTERVAL": "0"})
    gateway.start()
    remote = httpx.Client(base_url=f"http://{outside}:{gateway.admin_port}", timeout=5,
                          transport=httpx.HTTPTransport(local_address=outside))
    item = f"i{time.monotonic_ns()}"
    reset = f"/limits/stock/q?key={item}"
    try:
        assert httpx.get(gateway.url + "/echo/stock", headers={"X-Item": item}).status_code == 200
        assert httpx.get(gateway.url + "/echo/stock", headers={"X-Item": item}).status_code == 429

        refused = remote.delete(reset)
        assert refused.status_code == 403 and "loopback" in str(problem(refused)["detail"])
        assert remote.post("/reload").status_code == 403
        assert remote.get(reset).json()["remaining"] == 0, "reads stay open; the stock was not reset"
        assert httpx.get(gateway.url + "/echo/stock", headers={"X-Item": item}).status_code == 429

        local = httpx.delete(gateway.admin_url + reset)
        assert local.status_code == 200 and local.json()["reset"] is True
        assert httpx.get(gateway.url + "/echo/stock", headers={"X-Item": item}).status_code == 200

        # a token, once configured, is what counts: from anywhere with it, from nowhere without it
        gateway.config_path.write_text(gateway.config_path.read_text().replace('token: ""', 'token: "t0ken"'))
        assert httpx.post(gateway.admin_url + "/reload").status_code == 200  # still tokenless: loopback
        assert httpx.delete(gateway.admin_url + reset).status_code == 401
        assert remote.delete(reset).status_code == 401
        granted = remote.delete(reset, headers={"Authorization": "Bearer t0ken"})
        assert granted.status_code == 200 and granted.json()["reset"] is True
        # the scheme in any case, the token without the whitespace around it (before: 401)
        for spelled in ("bearer t0ken", "BEARER t0ken", "Bearer  t0ken"):  # (httpx sends no trailing space)
            assert remote.delete(reset, headers={"Authorization": spelled}).status_code == 200, spelled
        for wrong in ("Bearer t0ke", "Bearer t0ken2", "Basic t0ken", "Bearert0ken", "t0ken", "Bearer"):
            assert remote.delete(reset, headers={"Authorization": wrong}).status_code == 401, wrong
    finally:
        remote.close()
        assert gateway.stop() == 0


# --- the repository's example ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[GatewayProcess]:
    """The repository's own routes.yaml, as `make run` serves it, in front of the test upstream."""
    redis = RedisProcess()
    redis.start()
    gateway = GatewayProcess(REPO_ROUTES, tmp_path_factory.mktemp("example"), redis_url=redis.url,
                             env={"SHOP_URL": upstream.url})
    gateway.start()
    yield gateway
    assert gateway.stop() == 0
    redis.stop()


def test_the_order_endpoint_cannot_be_reached_around_its_limits(example: GatewayProcess) -> None:
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        response = httpx.request(method, example.url + "/seckill/42", headers=ORDER)
        assert response.status_code == 405, method
        assert response.headers["allow"] == "POST"
        assert "x-upstream" not in response.headers, "never forwarded"
        assert f"{method} is not allowed on /seckill/42" in str(problem(response)["detail"])
    for path in ("/seckill/42/", "/seckill/42/."):  # a trailing slash is the same resource
        refused = httpx.get(example.url + path, headers=ORDER)
        assert refused.status_code == 405 and "x-upstream" not in refused.headers, path
    order = httpx.post(example.url + "/seckill/42", headers=ORDER, content=b'{"qty": 7}')
    assert order.status_code == 200 and order.headers["x-upstream"] == "echo"
    assert 'RateLimit-Policy'.lower() in order.headers
    slash = httpx.post(example.url + "/seckill/42/", headers=ORDER, content=b'{"qty": 8}')
    assert slash.status_code == 200 and "ip-" not in slash.headers["ratelimit-policy"], "seckill's rules"
    assert httpx.get(example.url + "/seckill/42/reviews").status_code == 200, "other paths: the catch-all"
    stock = httpx.get(example.admin_url + "/limits/seckill/stock", params={"key": "42"}).json()
    assert stock["remaining"] == 98, "only the two POSTs took stock"


def test_the_example_backend_takes_orders_only_where_the_seckill_route_limits_them() -> None:
    from gateway.example_backend import app

    async def ask(method: str, path: str) -> tuple[int, dict[str, object]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client:
            answer = await client.request(method, path, content=b"{}")
            return answer.status_code, answer.json()

    for path in ("/seckill/42", "/seckill/42/"):
        assert asyncio.run(ask("POST", path))[1]["order"] == "accepted"
    for method, path in (("POST", "/seckill/42/x"), ("POST", "/seckill/"), ("GET", "/seckill/42"),
                         ("PUT", "/seckill/42")):
        status, body = asyncio.run(ask(method, path))
        assert status == 200 and "order" not in body, (method, path)


def test_a_forged_x_forwarded_for_does_not_escape_the_per_ip_limit(example: GatewayProcess) -> None:
    for rule in ("ip-minute", "ip-2min"):
        reset = httpx.delete(example.admin_url + f"/limits/api/{rule}", params={"key": "127.0.0.1"})
        assert reset.status_code == 200
    statuses = [httpx.get(example.url + "/products", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
                for i in range(12)]
    assert statuses == [200] * 10 + [429] * 2
    sent = httpx.get(example.url + "/echo", headers={"X-Forwarded-For": "198.51.100.77"})
    assert sent.status_code == 429  # still this client's limit, whatever it claims to be


def test_get_limits_lists_every_route_and_rule_with_its_parameters(example: GatewayProcess) -> None:
    listing = httpx.get(example.admin_url + "/limits")
    assert listing.status_code == 200
    routes = {r["name"]: r for r in listing.json()["routes"]}
    assert list(routes) == ["seckill", "login", "notifications", "chat", "internal", "api-pro", "api"]
    assert routes["chat"]["rules"][0]["cost"] == {"reserve": "request_json:max_tokens", "default": 200,
                                                  "settle": "response_json:usage.total_tokens"}
    seckill = routes["seckill"]
    assert seckill["match"] == {"path": "/seckill/{item_id:int}", "methods": ["POST"], "host": None}
    assert seckill["failure_mode"] == "closed" and seckill["upstream"] == "shop"
    rules = {r["name"]: r for r in seckill["rules"]}
    assert list(rules) == ["user", "item", "stock", "dedupe"]
    assert rules["user"] == {"name": "user", "algorithm": "token_bucket", "by": ["header:x-user-id"],
                             "rate_per_second": 5.0, "burst": 5, "cost": 1, "status": 429,
                             "shadow": False, "on_missing": "reject"}
    assert rules["item"]["limit"] == 1000 and rules["item"]["window_seconds"] == 1.0
    assert rules["stock"]["algorithm"] == "quota" and rules["stock"]["limit"] == 100
    assert rules["stock"]["refund_on"] == ["5xx"]  # as the file writes it
    assert routes["login"]["rules"][0]["count_on"] == [401]
    assert routes["internal"]["rules"] == []
    assert "period_seconds" not in rules["stock"], "a quota without period never refills"
    assert {k: rules["dedupe"][k] for k in ("algorithm", "limit", "window_seconds", "status", "by")} == {
        "algorithm": "sliding_log", "limit": 1, "window_seconds": 5.0, "status": 409,
        "by": ["header:x-user-id", "body"]}
    api = {r["name"]: r for r in routes["api"]["rules"]}
    assert list(api) == ["ip-minute", "ip-2min", "global", "in-flight"]
    assert api["in-flight"] == {"name": "in-flight", "algorithm": "concurrency", "by": ["ip"], "limit": 4,
                                "lease_seconds": 60.0, "cost": 1, "status": 429, "shadow": False,
                                "on_missing": "reject"}
    assert api["global"]["rate_per_second"] == 2000.0 and api["global"]["burst"] == 200


def test_healthz_says_whether_redis_answers_and_the_breaker_state(example: GatewayProcess) -> None:
    health = httpx.get(example.admin_url + "/healthz")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["ready"] is True and body["breaker"] == "closed"
    assert body["redis"]["answers"] is True and body["redis"]["latency_ms"] < 1000
    assert httpx.get(example.admin_url + "/readyz").json() == {"status": "ready", "routes": 7}
    unknown = httpx.get(example.admin_url + "/nothing-here")
    assert unknown.status_code == 404 and "no admin endpoint" in str(problem(unknown)["detail"])
    wrong = httpx.get(example.admin_url + "/reload")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    problem(wrong)


DEDUPE_AS_FIXED_WINDOW = REPO_ROUTES.replace(
    "algorithm: sliding_log, limit: 1, window: 5s, status: 409",
    "algorithm: fixed_window, limit: 1, window: 5s, status: 409")


@pytest.mark.parametrize(("routes", "second"), [(REPO_ROUTES, 409), (DEDUPE_AS_FIXED_WINDOW, 200)],
                         ids=["the-example-sliding_log", "the-old-fixed_window"])
def test_two_identical_orders_across_a_window_boundary_do_not_both_pass(
    routes: str, second: int, tmp_path: Path, clocked_redis: tuple[RedisProcess, RedisClock], upstream: Upstream
) -> None:
    """0.41 s apart, across a multiple of 5 s since the epoch (Redis's clock, moved by libfaketime)."""
    assert (routes == REPO_ROUTES) == ("sliding_log, limit: 1, window: 5s" in routes)
    redis, clock = clocked_redis
    boundary = (int(clock.now) // 5 + 2) * 5
    gateway = GatewayProcess(routes, tmp_path, redis_url=redis.url, env={"SHOP_URL": upstream.url})
    gateway.start()
    try:
        body = json.dumps({"item": 42, "qty": 1}).encode()
        clock.set(boundary - 0.2)
        first = httpx.post(gateway.url + "/seckill/42", headers=ORDER, content=body)
        clock.set(boundary + 0.21)
        again = httpx.post(gateway.url + "/seckill/42", headers=ORDER, content=body)
        assert first.status_code == 200
        assert again.status_code == second
        if second == 409:
            assert problem(again)["rule"] == "dedupe"
            assert int(again.headers["retry-after"]) == 5  # 4.59 s until the first leaves the 5 s
    finally:
        assert gateway.stop() == 0


# --- the embedded Redis and --data-dir ------------------------------------------------------------

STOCK = """
version: 1
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: sale
    match: {{path: /echo/sale}}
    upstream: up
    limits: [{{name: stock, by: [], algorithm: quota, limit: 3}}]
"""


def sell(gateway: GatewayProcess, n: int) -> list[int]:
    return [httpx.post(gateway.url + "/echo/sale").status_code for _ in range(n)]


def test_a_quota_survives_a_restart_with_data_dir_and_not_with_ephemeral(tmp_path: Path, upstream: Upstream) -> None:
    data = tmp_path / "state"
    kept = GatewayProcess(STOCK.format(upstream=upstream.url), tmp_path, env={"GATEWAY_DATA_DIR": str(data)})
    kept.start()
    try:
        assert sell(kept, 2) == [200, 200]
        assert kept.stop() == 0
        assert f"state persists in {data}" in kept.log()
        assert (data / "gateway.aof").exists() or any(data.iterdir())
        kept.start()
        assert sell(kept, 3) == [200, 429, 429], "two of three were sold before the restart"
        assert httpx.get(kept.admin_url + "/limits/sale/stock").json()["remaining"] == 0
    finally:
        assert kept.stop() == 0

    other = tmp_path / "memory"
    other.mkdir()
    lost = GatewayProcess(STOCK.format(upstream=upstream.url), other, args=("--ephemeral",))
    lost.start()
    try:
        assert sell(lost, 2) == [200, 200]
        assert lost.stop() == 0
        assert "state is in memory only and gone when the gateway exits" in lost.log()
        lost.start()
        assert sell(lost, 3) == [200, 200, 200], "with --ephemeral the stock is full again"
    finally:
        assert lost.stop() == 0


def test_data_dir_with_a_redis_url_says_it_is_ignored(tmp_path: Path, upstream: Upstream) -> None:
    redis = RedisProcess()
    redis.start()
    gateway = GatewayProcess(STOCK.format(upstream=upstream.url), tmp_path, redis_url=redis.url,
                             args=("--data-dir", str(tmp_path / "state")))
    try:
        gateway.start()
        assert sell(gateway, 1) == [200]
    finally:
        assert gateway.stop() == 0
        redis.stop()
    assert f"--data-dir {tmp_path / 'state'} is ignored: a Redis URL is configured" in gateway.log()
    assert not (tmp_path / "state").exists()


# --- the command line -----------------------------------------------------------------------------

def gateway_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def test_version() -> None:
    from importlib.metadata import version

    shown = gateway_cli("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"gateway {version('ratelimit-gateway')}"


def test_serve_without_a_routes_file_names_the_path_and_the_flag(tmp_path: Path) -> None:
    result = gateway_cli("serve", "--port", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert str(tmp_path / "routes.yaml") in result.stderr and "--config" in result.stderr
    result = gateway_cli("serve", "--config", str(tmp_path / "nope.yaml"), "--port", "0")
    assert result.returncode == 2 and "nope.yaml" in result.stderr and "--config" in result.stderr


@pytest.mark.parametrize("which", ["--port", "--admin-port", "--check-port"])
def test_a_port_in_use_is_named_with_the_flag_that_moves_it(which: str, tmp_path: Path) -> None:
    from tests.support.ports import free_port

    (tmp_path / "routes.yaml").write_text("version: 1\nroutes: []\n")
    ports = {flag: free_port() for flag in ("--port", "--admin-port", "--check-port")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[which]))
        taken.listen()
        result = gateway_cli("serve", "--host", "127.0.0.1", "--ephemeral",
                             *(str(part) for pair in ports.items() for part in pair), cwd=tmp_path)
    assert result.returncode == 1
    assert f"127.0.0.1:{ports[which]}: Address already in use ({which} picks another)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_admin_host_defaults_to_loopback() -> None:
    from gateway.cli import parse_args, resolve_settings

    settings = resolve_settings(parse_args(["serve", "--host", "0.0.0.0"]), {})
    assert settings.host == "0.0.0.0" and settings.effective_admin_host == "127.0.0.1"
    settings = resolve_settings(parse_args(["serve", "--data-dir", "/var/lib/gw"]), {"GATEWAY_ADMIN_HOST": "::"})
    assert settings.effective_admin_host == "::" and settings.data_dir == "/var/lib/gw"


def test_another_method_on_an_owned_path_needs_a_route_that_names_it() -> None:
    from gateway.config import Route, Upstream
    from gateway.match import Router

    up = Upstream("up", "http://127.0.0.1:1")
    router = Router([
        Route("seckill", "/seckill/{item_id}", frozenset({"POST"}), None, up, ()),
        Route("preflight", "/seckill/{item_id}", frozenset({"OPTIONS"}), None, up, ()),
        Route("api", "/{rest:path}", None, None, up, ()),
    ])
    found = router.match("OPTIONS", "shop", "/seckill/42")
    assert found is not None and found[0].name == "preflight"
    assert router.match("GET", "shop", "/seckill/42") is None
    assert router.allowed_methods("shop", "/seckill/42") == {"OPTIONS", "POST"}
    other = router.match("GET", "shop", "/products")
    assert other is not None and other[0].name == "api"


def test_the_example_backend_answers_like_an_llm_api_and_the_budget_is_spent() -> None:
    """`make run`'s example: the chat route's budgets spend what the example backend's usage says."""
    import asyncio

    from gateway.example_backend import app

    async def ask(stream: bool) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://example") as client:
            return await client.post("/v1/chat/completions", json={"max_tokens": 3, "stream": stream})

    plain = asyncio.run(ask(False))
    assert plain.json()["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    streamed = asyncio.run(ask(True))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert '"total_tokens": 15' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
