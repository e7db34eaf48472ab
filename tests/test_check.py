"""The check endpoint (gateway/check.py, SPEC section 7) as the proxies in front ask it: each
forward-auth convention, read exactly as the proxy port reads a request (canonical values, one
Host, duplicate identities refused), sharing its counters; hostile forwarding headers answered 400
with nothing counted; Redis down under each failure mode; and a file it cannot serve refused at
start-up with file:line:key. The real nginx, Caddy and Envoy in front: tests/test_check_proxies.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.raw_http import Conn
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 50ms}}
access_log: true
trusted_proxies: [127.0.0.1/32]
check: {{path_prefix: /check{deny}{convention}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: shop
    match: {{path: "/shop/{{item}}", methods: [GET, POST]}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 3, period: 1h}}]
  - name: per-ip
    match: {{path: /ip}}
    upstream: up
    limits: [{{name: ip, by: [ip], algorithm: quota, limit: 1}}]
  - name: closed
    match: {{path: /closed}}
    upstream: up
    failure_mode: closed
    limits: [{{name: g, by: [], algorithm: gcra, rate: 1000/s, burst: 1000}}]
  - name: open
    match: {{path: /open}}
    upstream: up
    limits: [{{name: g, by: [], algorithm: gcra, rate: 1000/s, burst: 1000}}]
  - name: leaky
    match: {{path: /leaky}}
    upstream: up
    limits: [{{name: drip, by: [header:X-Run], algorithm: leaky_bucket, rate: 5/s, burst: 5}}]
"""


def _gateway(tmp_path: Path, redis: RedisProcess, upstream: Upstream, deny: str = "",
             convention: str = "", http: str = "gateway") -> GatewayProcess:
    check_port = free_port()
    config = CONFIG.format(upstream=upstream.url, deny=deny, convention=convention)
    gateway = GatewayProcess(config, tmp_path, redis_url=redis.url,
                             args=("--check-port", str(check_port)), http=http)
    gateway.check_url = f"http://127.0.0.1:{check_port}"  # type: ignore[attr-defined]
    gateway.start()
    return gateway


@pytest.fixture
def redis() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def gateway(tmp_path: Path, redis: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    proc = _gateway(tmp_path, redis, upstream)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def _own_redis_gateway(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream,
                       http: str = "gateway") -> Iterator[GatewayProcess]:
    """A module's gateway with a Redis of its own, both stopped at the end."""
    redis = RedisProcess()
    redis.start()
    proc = _gateway(tmp_path_factory.mktemp("check"), redis, upstream, http=http)
    try:
        yield proc
    finally:
        assert proc.stop() == 0
        redis.stop()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module", params=["gateway", "uvicorn"])
def either_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  upstream: Upstream) -> Iterator[GatewayProcess]:
    """The check port on the gateway's server (its door: the answer written whole) and on uvicorn's
    own protocol, which has no doors (the endpoint as an ASGI app): the same answers."""
    yield from _own_redis_gateway(tmp_path_factory, upstream, http=request.param)


@pytest.fixture(scope="module")
def shared_gateway(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[GatewayProcess]:
    yield from _own_redis_gateway(tmp_path_factory, upstream)


def check(gateway: GatewayProcess, headers: dict[str, str] | list[tuple[str, str]], path: str = "/",
          method: str = "GET") -> httpx.Response:
    url: str = gateway.check_url  # type: ignore[attr-defined]
    return httpx.request(method, url + path, headers=headers)


def traefik(method: str, uri: str, user: str, host: str = "shop.example") -> dict[str, str]:
    """What Traefik's ForwardAuth and Caddy's forward_auth send (Traefik has no package here)."""
    return {"X-Forwarded-Method": method, "X-Forwarded-Uri": uri, "X-Forwarded-Host": host,
            "X-Forwarded-Proto": "http", "X-Forwarded-For": "203.0.113.9", "X-User-Id": user}


def nginx(method: str, uri: str, user: str) -> dict[str, str]:
    """nginx auth_request with the documented recipe (X-Original-URI $request_uri, Host $host)."""
    return {"X-Original-Method": method, "X-Original-URI": uri, "Host": "shop.example", "X-User-Id": user}


def ingress_nginx(method: str, uri: str, user: str) -> dict[str, str]:
    return {"X-Original-Method": method, "X-Original-URL": f"https://shop.example{uri}", "X-User-Id": user}


CONVENTIONS = {"traefik/caddy": traefik, "nginx": nginx, "ingress-nginx": ingress_nginx}


@pytest.mark.parametrize("convention", [*CONVENTIONS, "envoy"])
def test_each_convention_is_decided_as_the_proxy_port_decides_it(either_server: GatewayProcess,
                                                                 convention: str) -> None:
    gateway = either_server
    user = f"user-{convention}"
    statuses = []
    for _ in range(4):
        if convention == "envoy":  # ext_authz: the original request line behind check.path_prefix
            answer = check(gateway, {"X-User-Id": user, "Host": "shop.example"}, "/check/shop/42?x=1", "POST")
        else:
            answer = check(gateway, CONVENTIONS[convention]("POST", "/shop/42?x=1", user))
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            assert answer.content == b""
            assert answer.headers["ratelimit-policy"] and answer.headers["ratelimit"]
        else:
            assert 0 < int(answer.headers["retry-after"]) <= 3600  # the quota's hour ends
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["status"] == 429
    assert statuses == [200, 200, 200, 429]


def test_the_check_and_the_proxy_port_share_one_counter(gateway: GatewayProcess) -> None:
    headers = {"X-User-Id": "shared"}
    assert [httpx.get(gateway.url + "/shop/1", headers=headers).status_code for _ in range(2)] == [200, 200]
    assert check(gateway, traefik("GET", "/shop/1", "shared")).status_code == 200
    assert httpx.get(gateway.url + "/shop/1", headers=headers).status_code == 429
    assert check(gateway, nginx("GET", "/shop/1", "shared")).status_code == 429


def test_no_route_and_another_method_pass(gateway: GatewayProcess) -> None:
    assert check(gateway, traefik("GET", "/nowhere", "a")).status_code == 200
    assert check(gateway, traefik("DELETE", "/shop/1", "a")).status_code == 200  # the route takes GET, POST


def test_values_are_read_as_the_upstream_reads_them(gateway: GatewayProcess) -> None:
    """Whitespace trimmed, dot segments and unreserved escapes normalized, the host lowercased: each
    spelling is the same request, and the same counter."""
    port = int(gateway.check_url.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    with Conn(port) as conn:  # httpx will not send a value with whitespace around it
        conn.send(b"GET / HTTP/1.1\r\nHost: check\r\nX-Forwarded-Method: GET\r\n"
                  b"X-Forwarded-Uri:  /shop/7 \r\nX-User-Id: \t spaced  \r\n\r\n")
        assert conn.response()[0] == 200
    spellings = [
        traefik("GET", "/shop/./7", "spaced"),
        traefik("GET", "/%73hop//7", "spaced", host="SHOP.example."),
    ]
    assert [check(gateway, h).status_code for h in spellings] == [200, 200]
    assert check(gateway, traefik("GET", "/shop/7", "spaced")).status_code == 429


@pytest.mark.parametrize(("headers", "why"), [
    ([("X-Forwarded-Method", "GET"), ("X-Forwarded-Uri", "/shop/9"), ("X-Forwarded-Uri", "/other"),
      ("X-User-Id", "hostile")], "more than once"),
    ([("X-Forwarded-Method", "GET"), ("X-Forwarded-Uri", "http://evil.example/shop/9"), ("X-User-Id", "hostile")],
     "origin-form"),
    ([("X-Forwarded-Method", "GET"), ("X-Forwarded-Uri", "/../shop/9"), ("X-User-Id", "hostile")], "root"),
    ([("X-Forwarded-Method", "GET"), ("X-Forwarded-Uri", "/shop/%2e%2e/%2e%2e/x"), ("X-User-Id", "hostile")],
     "root"),
    ([("X-Forwarded-Uri", "/shop/9"), ("X-User-Id", "hostile")], "X-Forwarded-Method is missing"),
    ([("X-Forwarded-Method", "G ET"), ("X-Forwarded-Uri", "/shop/9"), ("X-User-Id", "hostile")], "method"),
    ([("X-Original-Method", "GET"), ("X-Original-URL", "javascript://shop.example/shop/9"),
      ("X-User-Id", "hostile")], "absolute http(s) URL"),
    ([("X-Original-Method", "GET"), ("X-Original-URI", "/shop/9"), ("X-User-Id", "hostile"),
      ("X-User-Id", "other")], "more than once"),
    # ingress-nginx writes X-Original-URL and passes the client's fields along (an outside probe:
    # before, the client's X-Original-URI or X-Forwarded-Host was what counted)
    ([("X-Original-Method", "GET"), ("X-Original-URL", "http://shop.example/shop/9"),
      ("X-Original-URI", "/nowhere"), ("X-User-Id", "hostile")], "different requests"),
    ([("X-Original-Method", "GET"), ("X-Original-URL", "http://shop.example/shop/9"),
      ("X-Forwarded-Host", "other.example"), ("X-User-Id", "hostile")], "different hosts"),
    ([("X-Forwarded-Method", "GET"), ("X-Forwarded-Uri", "/shop/9"), ("X-Forwarded-Host", "a.example"),
      ("X-Forwarded-Host", "b.example"), ("X-User-Id", "hostile")], "more than once"),
])
def test_hostile_forwarding_headers_are_a_400_and_count_nothing(
        shared_gateway: GatewayProcess, headers: list[tuple[str, str]], why: str) -> None:
    user = f"hostile-{uuid.uuid4().hex[:8]}"  # the cases share a gateway: each counts its own user
    answer = check(shared_gateway, [(name, user if value == "hostile" else value) for name, value in headers])
    assert answer.status_code == 400, answer.text
    assert why in answer.json()["detail"]
    # nothing was counted: the user still has the whole quota of 3
    counted = [check(shared_gateway, traefik("GET", "/shop/9", user)).status_code for _ in range(4)]
    assert counted == [200, 200, 200, 429]


def test_an_envoy_check_outside_the_path_prefix_is_a_400(gateway: GatewayProcess) -> None:
    answer = check(gateway, {"X-User-Id": "e"}, "/checkout/shop/1")
    assert answer.status_code == 400 and "path_prefix" in answer.json()["detail"]


def test_the_client_address_comes_through_the_trusted_proxies(gateway: GatewayProcess) -> None:
    def from_client(address: str) -> int:
        return check(gateway, {**traefik("GET", "/ip", "x"), "X-Forwarded-For": address}).status_code

    assert [from_client("198.51.100.1"), from_client("198.51.100.2")] == [200, 200]
    assert [from_client("198.51.100.1"), from_client("198.51.100.2")] == [429, 429]


def test_the_access_log_and_metrics_name_the_original_request(gateway: GatewayProcess) -> None:
    check(gateway, traefik("POST", "/shop/55?q=1", "logged"))
    check(gateway, traefik("POST", "/shop/55?q=2", "logged"))

    def logged() -> list[dict[str, object]]:
        return [json.loads(line) for line in gateway.out_path.read_text().splitlines() if line.startswith("{")]

    wait_until(lambda: sum(e.get("path") == "/shop/55" for e in logged()) == 2, timeout=5)
    entries = [e for e in logged() if e.get("path") == "/shop/55"]
    entry = entries[0]
    assert entry["method"] == "POST" and entry["route"] == "shop" and entry["decision"] == "admitted"
    ids = [e["request_id"] for e in entries]  # a check answers no X-Request-Id; its log line has one of its own
    assert all(isinstance(i, str) and len(i) == 32 for i in ids) and ids[0] != ids[1]
    metrics = httpx.get(gateway.admin_url + "/metrics").text
    assert 'gateway_requests_total{decided_by="redis",outcome="admitted",route="shop"}' in metrics


def test_deny_status_turns_every_refusal_into_it_with_the_original_status(
        tmp_path: Path, redis: RedisProcess, upstream: Upstream) -> None:
    gateway = _gateway(tmp_path, redis, upstream, deny=", deny_status: 403")
    try:
        statuses = [check(gateway, nginx("GET", "/shop/3", "nginx-user")) for _ in range(4)]
        assert [a.status_code for a in statuses] == [200, 200, 200, 403]
        refused = statuses[-1]
        assert refused.headers["x-ratelimit-status"] == "429" and "retry-after" in refused.headers
        bad = check(gateway, [("X-Original-Method", "GET"), ("X-Original-URI", "/../x")])
        assert bad.status_code == 403 and bad.headers["x-ratelimit-status"] == "400"
        assert redis.process is not None
        redis.process.kill()
        redis.process.wait()
        assert check(gateway, nginx("GET", "/open", "u")).status_code == 200
        closed = check(gateway, nginx("GET", "/closed", "u"))
        assert closed.status_code == 403 and closed.headers["x-ratelimit-status"] == "503"
        assert closed.headers["retry-after"] == "1"
    finally:
        assert gateway.stop() == 0
    assert "Traceback" not in gateway.log()


def test_redis_down_follows_each_routes_failure_mode(gateway: GatewayProcess, redis: RedisProcess) -> None:
    assert redis.process is not None
    redis.process.kill()
    redis.process.wait()
    for _ in range(3):
        assert check(gateway, traefik("GET", "/open", "u")).status_code == 200
        closed = check(gateway, traefik("GET", "/closed", "u"))
        assert closed.status_code == 503 and closed.headers["retry-after"] == "1"


ANSWER_RULES = [
    ("{name: c, by: [], algorithm: concurrency, limit: 2}", "algorithm"),
    ("{name: c, by: [], algorithm: quota, limit: 2, count_on: [5xx]}", "count_on"),
    ("{name: c, by: [], algorithm: quota, limit: 2, refund_on: [5xx]}", "refund_on"),
    ("{name: c, by: [], algorithm: quota, limit: 2, cost: 'response_header:X-Tokens'}", "cost"),
    ("{name: c, by: [body], algorithm: quota, limit: 2}", "by"),
]


@pytest.mark.parametrize(("rule", "key"), ANSWER_RULES)
def test_a_rule_that_needs_the_answer_fails_start_up_with_the_check_port_on(
        tmp_path: Path, rule: str, key: str) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("version: 1\nupstreams: {up: {url: 'http://127.0.0.1:1'}}\nroutes:\n"
                      "  - name: r\n    match: {path: /r}\n    upstream: up\n    limits:\n"
                      f"      - {rule}\n")
    serve = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(free_port()),
             "--admin-port", str(free_port())]
    refused = subprocess.run([*serve, "--check-port", str(free_port())], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2
    assert f"routes.yaml:8: routes[0](r).limits[0](c).{key}: needs the upstream's answer" in refused.stderr
    checked = subprocess.run([sys.executable, "-m", "gateway", "check", str(config)], capture_output=True,
                             text=True, timeout=30, env={**_env(), "GATEWAY_CHECK_PORT": "9191"})
    assert checked.returncode == 2 and f"(c).{key}" in checked.stderr
    alone = subprocess.run([sys.executable, "-m", "gateway", "check", str(config)], capture_output=True, text=True,
                           timeout=30, env=_env())
    assert alone.returncode == 0, alone.stderr  # without the check port, the same file is fine


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "GATEWAY_CHECK_PORT"}


def test_a_pinned_convention_believes_no_other(tmp_path: Path, redis: RedisProcess, upstream: Upstream) -> None:
    """Through a proxy that passes the client's headers on, `auto` would believe a client's own
    X-Forwarded-Uri over nginx's X-Original-URI; `convention: original` reads only nginx's."""
    gateway = _gateway(tmp_path, redis, upstream, convention=", convention: original")
    try:
        spoofed = {**nginx("GET", "/shop/8", "pinned"), "X-Forwarded-Method": "GET", "X-Forwarded-Uri": "/free"}
        assert [check(gateway, spoofed).status_code for _ in range(4)] == [200, 200, 200, 429]
        envoy_style = check(gateway, {"X-User-Id": "pinned", "Host": "shop.example"}, "/check/shop/8")
        assert envoy_style.status_code == 400 and "X-Original-Method is missing" in envoy_style.json()["detail"]
    finally:
        assert gateway.stop() == 0


def test_auto_reads_the_first_convention_the_request_carries(gateway: GatewayProcess) -> None:
    spoofed = {**nginx("GET", "/shop/8", "auto"), "X-Forwarded-Method": "GET", "X-Forwarded-Uri": "/free"}
    assert [check(gateway, spoofed).status_code for _ in range(4)] == [200] * 4  # /free: no route


def test_a_leaky_bucket_delays_the_checks_answer_so_the_proxy_forwards_at_the_rate(gateway: GatewayProcess) -> None:
    """The proxy in front waits for the check's answer: a leaky bucket's place in the queue is that
    wait (as on the proxy port, where the gateway itself holds the request)."""
    async def run() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=gateway.check_url, timeout=10) as client:  # type: ignore[attr-defined]
            async def one() -> tuple[int, float]:
                answer = await client.get("/", headers={**traefik("GET", "/leaky", "u"), "X-Run": "drip-run"})
                return answer.status_code, time.monotonic()

            return await asyncio.gather(*[one() for _ in range(8)])

    answers = asyncio.run(run())
    admitted = sorted(at for status, at in answers if status == 200)
    assert len(admitted) == 6 and sum(status == 429 for status, _ in answers) == 2
    assert admitted[-1] - admitted[0] >= 0.95  # spaced at the rate (5/s): 5 intervals
