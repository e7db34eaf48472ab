"""`shared:` rules (issue 30): one counter wherever a route names it ({use: NAME}), decided in each
route's one script call, all or nothing, exact with 8 gateway processes racing, on Redis Cluster too."""

from __future__ import annotations

import asyncio
import textwrap
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.keys import SHARED_TAG, slot
from gateway.plan import route_plan
from tests.support.cluster import RedisCluster
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{url: "{redis}", timeout: 2s, key_prefix: {prefix}{mode}}}
upstreams: {{up: {{url: "{upstream}"}}}}
shared:
  - {{name: api-global, by: [], algorithm: fixed_window, limit: 40, window: 1h}}
  - {{name: per-key, by: ["header:X-Api-Key"], algorithm: quota, limit: 6, period: 1d}}
routes:
  - name: search
    match: {{path: "/echo/search"}}
    upstream: up
    limits:
      - {{use: api-global}}
      - {{use: per-key}}
      - {{name: ip, by: [ip], algorithm: fixed_window, limit: 1000, window: 1h}}
  - name: orders
    match: {{path: "/echo/orders/{{item}}"}}
    upstream: up
    limits:
      - {{use: per-key}}
      - {{use: api-global}}
      - {{name: stock, by: ["path:item"], algorithm: quota, limit: 2}}
  - name: free
    match: {{path: "/echo/free"}}
    upstream: up
    limits: [{{name: ip, by: [ip], algorithm: fixed_window, limit: 1000, window: 1h}}]
"""


def _config(redis: str, upstream: str, mode: str = "") -> str:
    return CONFIG.format(redis=redis, upstream=upstream, prefix=f"s{uuid.uuid4().hex[:8]}", mode=mode)


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent(text), "routes.yaml", {})
    return [str(p) for p in raised.value.problems]


# --- the file -------------------------------------------------------------------------------------

def test_a_shared_rule_is_one_rule_with_one_key_prefix_in_every_route_that_uses_it() -> None:
    config = parse_config(_config("redis://x:1", "http://u:1"), "routes.yaml", {})
    search, orders, _ = config.routes
    assert [r.name for r in search.limits] == ["api-global", "per-key", "ip"]
    assert search.limits[0] is orders.limits[1] and search.limits[0].shared and not search.limits[2].shared
    plans = [route_plan(route, "p", None) for route in config.routes]
    assert plans[0].prefix_keys[0] == plans[1].prefix_keys[1] == "p:{~shared}:api-global:"
    assert plans[0].prefix_keys[2] == "p:{~shared}:search/ip:"   # the route's own rule, beside it
    assert plans[2].prefix_keys[0] == "p:{free}:ip:"              # a route without one: as before
    assert all("{" + SHARED_TAG + "}" in key for key in (*plans[0].prefix_keys, *plans[1].prefix_keys))  # one slot


def test_use_names_a_shared_rule_and_nothing_else() -> None:
    shown = _problems("""\
        version: 1
        upstreams: {up: {url: "http://u:1"}}
        shared:
          - {name: api-global, by: [], algorithm: gcra, rate: 10/s, burst: 10}
          - {name: api-global, by: [ip], algorithm: gcra, rate: 10/s, burst: 10}
          - {name: refunds, by: [ip], algorithm: quota, limit: 5, refund_on: [5xx]}
        routes:
          - name: a
            match: {path: /a}
            upstream: up
            shards: 2
            limits:
              - {name: ip, by: [ip], algorithm: gcra, rate: 10/s, burst: 10}
              - {use: api-globl}
              - {use: api-global, limit: 3}
        """)
    assert any(":5: shared[1](api-global).name: shared rule 'api-global' is defined twice" in s for s in shown), shown
    assert any(":6: shared[2](refunds): a shared rule is counted at admission only" in s for s in shown), shown
    assert any(":14: routes[0](a).limits[1].use: no shared rule named 'api-globl' (did you mean api-global?)"
               in s for s in shown), shown
    assert any(":15: routes[0](a).limits[2].limit:" in s for s in shown), shown  # {use} takes nothing else
    assert any(":11: routes[0](a).shards: a route that uses a shared rule" in s for s in shown), shown


def test_the_schema_takes_shared_rules_and_use() -> None:
    from tests.test_schema import schema_errors

    assert schema_errors(yaml.safe_load(_config("redis://x:1", "http://u:1"))) == []
    bad = yaml.safe_load(_config("redis://x:1", "http://u:1").replace("{use: per-key}", "{use: per-key, x: 1}", 1))
    assert schema_errors(bad) != []


# --- one counter, every route, exact --------------------------------------------------------------

def test_one_counter_wherever_it_is_used_all_or_nothing(redis_proc: RedisProcess, upstream: Upstream,
                                                        tmp_path: Path) -> None:
    gateway = GatewayProcess(_config(redis_proc.url, upstream.url), tmp_path)
    gateway.start()
    try:
        with httpx.Client(base_url=gateway.url) as client:
            key = {"X-Api-Key": "k-" + uuid.uuid4().hex}
            statuses = [client.get("/echo/search", headers=key).status_code for _ in range(3)]
            statuses += [client.post(f"/echo/orders/{i}", headers=key).status_code for i in range(3)]
            assert statuses == [200] * 6  # six a day for this key, over both routes
            assert client.get("/echo/search", headers=key).status_code == 429
            refused = client.post("/echo/orders/9", headers=key)
            assert refused.status_code == 429 and refused.json()["rule"] == "per-key"
            # all or nothing: a refusal by the route's own rule spends nothing of the shared ones
            other = {"X-Api-Key": "k-" + uuid.uuid4().hex}
            assert [client.post("/echo/orders/7", headers=other).status_code for _ in range(3)] == [200, 200, 429]
            admin = httpx.get(f"{gateway.admin_url}/limits/search/per-key", params={"key": other["X-Api-Key"]}).json()
            assert admin["remaining"] == 4 and admin["limit"] == 6
            same = httpx.get(f"{gateway.admin_url}/limits/orders/per-key", params={"key": other["X-Api-Key"]}).json()
            assert same["key"] == admin["key"]  # one key, whichever route names it
            assert httpx.get(f"{gateway.admin_url}/limits").json()["routes"][0]["rules"][0]["shared"] is True
            put = httpx.put(f"{gateway.admin_url}/overrides/search/per-key", params={"key": "k"}, json={"limit": 9})
            assert put.status_code == 409 and "shared rule" in put.json()["detail"]
    finally:
        assert gateway.stop() == 0


def test_eight_gateways_racing_over_two_routes_admit_exactly_the_shared_limit(
        redis_proc: RedisProcess, upstream: Upstream, tmp_path: Path) -> None:
    config = _config(redis_proc.url, upstream.url)
    for i in range(8):
        (tmp_path / f"g{i}").mkdir()
    gateways = [GatewayProcess(config, tmp_path / f"g{i}") for i in range(8)]
    for gateway in gateways:
        gateway.start()
    try:
        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
                calls = []
                for n in range(120):  # 120 requests, 40 a day over the whole API, each with a key of its own
                    gateway = gateways[n % 8]
                    path = "/echo/search" if n % 2 else f"/echo/orders/{n}"
                    calls.append(client.request("GET" if n % 2 else "POST", gateway.url + path,
                                                headers={"X-Api-Key": f"race-{n}"}))
                return [r.status_code for r in await asyncio.gather(*calls)]

        statuses = asyncio.run(flood())
        assert statuses.count(200) == 40 and statuses.count(429) == 80, sorted(statuses)
    finally:
        for gateway in gateways:
            assert gateway.stop() == 0


def test_shared_rules_on_redis_cluster(cluster: RedisCluster, upstream: Upstream, tmp_path: Path) -> None:
    """Every key of a route that uses a shared rule lives in the `{~shared}` slot: one call, one node."""
    gateway = GatewayProcess(_config(cluster.url, upstream.url, mode=", mode: cluster"), tmp_path, workers=2)
    gateway.start()
    try:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
                calls = [client.post(f"/echo/orders/{i % 30}", headers={"X-Api-Key": f"c{i}"}) for i in range(60)]
                calls += [client.get("/echo/search", headers={"X-Api-Key": f"d{i}"}) for i in range(10)]
                return [r.status_code for r in await asyncio.gather(*calls)]

        statuses = asyncio.run(burst())
        assert statuses.count(200) == 40 and statuses.count(429) == 30
        owner = cluster.owner_of_slot(slot(SHARED_TAG))
        assert owner.client().keys("*{~shared}:api-global:*")
    finally:
        assert gateway.stop() == 0
