"""API keys and plans at runtime (gateway/api_keys.py, gateway/admin/keys.py; issue 30): keys
registered on the admin port, stored as digests, followed by every gateway within 2 s without a
Redis call per request; unknown keys are 401s, never forwarded."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api_keys import KeyTable, digest, fingerprint
from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

APPLIES_WITHIN = 2.0  # seconds: the bar (scaled by the suite's time factor in wait_until)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["free", "pro", None])), max_size=80),
       st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["free", "pro"])), max_size=20))
def test_the_table_is_a_map_of_digests_to_plans(changes: list[tuple[int, str | None]],
                                                 loaded: list[tuple[int, str]]) -> None:
    table, model = KeyTable(), dict(loaded)
    table.load([(digest(b"k%d" % n), plan) for n, plan in model.items()], 1)
    for n, plan in changes:
        table.apply({digest(b"k%d" % n): plan}, 2)
        if plan is None:
            model.pop(n, None)
        else:
            model[n] = plan
    assert len(table) == len(model)
    for n in range(41):
        assert table.plan(b"k%d" % n) == model.get(n)
    assert list(table.digests) == sorted(table.digests)


def test_keys_and_plans_in_the_file() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent("""\
            version: 1
            keys: {source: "header:X-Api-Key", plans: [free, pro, none]}
            upstreams: {up: {url: "http://u:1"}}
            routes:
              - name: r
                match: {path: /r, plan: prp}
                upstream: up
            """), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":2: keys.plans: `none` is the plan of an unknown key" in s for s in shown), shown
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent("""\
            version: 1
            keys: {source: "header:X-Api-Key", plans: [free, pro]}
            upstreams: {up: {url: "http://u:1"}}
            routes:
              - name: r
                match: {path: /r, plan: [prp, free]}
                upstream: up
              - name: s
                match: {path: /s, plan: none}
                upstream: up
            """), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":6: routes[0](r).match.plan: no plan named 'prp' in keys.plans (did you mean pro?)" in s
               for s in shown), shown
    assert any(":9: routes[1](s).match.plan: no plan named 'none'" in s for s in shown), shown  # unknown: reject
    with pytest.raises(ConfigError) as raised:
        parse_config("version: 1\nupstreams: {up: {url: 'http://u:1'}}\nroutes:\n"
                     "  - {name: r, match: {path: /r, plan: pro}, upstream: up}\n", "routes.yaml", {})
    assert "needs a top-level keys: section" in str(raised.value.problems[0])


CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "header:X-Api-Key", unknown: {unknown}, plans: [free, pro]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api-pro
    match: {{path: /echo/api, plan: pro}}
    upstream: up
    limits: [{{name: pro-minute, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 100, window: 1m}}]
  - name: api
    match: {{path: /echo/api}}
    upstream: up
    limits: [{{name: free-minute, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 2, window: 1m}}]
"""


@pytest.fixture
def pair(tmp_path: Path, upstream: Upstream) -> Iterator[tuple[GatewayProcess, GatewayProcess, RedisProcess]]:
    redis = RedisProcess()  # its own: the test counts its calls
    redis.start()
    config = CONFIG.format(prefix=f"a{uuid.uuid4().hex[:8]}", upstream=upstream.url, unknown="reject")
    gateways = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            gateways.append(GatewayProcess(config, tmp_path / name, redis_url=redis.url))
            gateways[-1].start()
        yield gateways[0], gateways[1], redis
    finally:
        for gateway in gateways:
            assert gateway.stop() == 0
        redis.stop()


def _calls(redis: RedisProcess) -> int:
    stats = redis.client().info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _status(gateway: GatewayProcess, key: str | None) -> int:
    return httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": key} if key else {}).status_code


def _until_status(gateway: GatewayProcess, key: str, status: int) -> None:
    wait_until(lambda: _status(gateway, key) == status, timeout=APPLIES_WITHIN)


def _rule(gateway: GatewayProcess, key: str) -> str:
    answer = httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": key})
    return str(answer.headers.get("ratelimit-policy", "")).split(";")[0].strip('"')


def test_keys_registered_at_runtime_reach_every_gateway_and_unknown_keys_never_pass(
        pair: tuple[GatewayProcess, GatewayProcess, RedisProcess]) -> None:
    a, b, redis = pair
    with httpx.Client(base_url=a.admin_url) as admin:
        _follow(a, b, redis, admin)


def _follow(a: GatewayProcess, b: GatewayProcess, redis: RedisProcess, admin: httpx.Client) -> None:
    key = "sk_live_" + uuid.uuid4().hex
    # unknown and absent keys: 401 problem+json, from memory (no Redis call), never forwarded
    before = _calls(redis)
    answers = [httpx.get(a.url + "/echo/api", headers={"X-Api-Key": f"invented-{n}"}) for n in range(100)]
    assert {r.status_code for r in answers} == {401} and _calls(redis) - before < 20  # the 1 s sync's reads only
    first = answers[0]
    assert first.headers["content-type"] == "application/problem+json" and "www-authenticate" in first.headers
    assert first.json()["detail"] == "unknown API key" and "echo" not in first.text
    assert _status(a, None) == 401 and httpx.get(a.url + "/echo/api").json()["detail"].startswith("no API key")
    # registered: every gateway follows within 2 s; its plan picks the route
    mark = fingerprint(digest(key.encode()))
    put = admin.put("/keys", params={"key": key}, json={"plan": "free"})
    assert put.status_code == 200 and put.json() == {"key": mark, "plan": "free", "consumer": mark, "metadata": {}}
    for gateway in (a, b):
        _until_status(gateway, key, 200)
    assert _rule(a, key) == "free-minute" and _status(b, key) == 429  # 2 a minute on the free plan, both counted
    assert admin.put("/keys", params={"key": key}, json={"plan": "pro"}).status_code == 200
    for gateway in (a, b):
        wait_until(lambda: _rule(gateway, key) == "pro-minute", timeout=APPLIES_WITHIN)  # noqa: B023
    # read back by the key or its fingerprint; listed by plan, fingerprints only
    assert admin.get("/keys", params={"key": mark}).json() == {"key": mark, "plan": "pro", "consumer": mark,
                                                               "metadata": {}}  # a consumer of its own
    listed = admin.get("/keys", params={"plan": "pro", "limit": 1000}).json()
    assert listed["keys"] == [mark] and key not in json.dumps(listed)
    # never stored as itself
    client = redis.client()
    stored = [k for k in client.keys("*")]
    assert all(key.encode() not in k for k in stored)
    assert all(key.encode() not in field for k in stored if client.type(k) == b"hash" for field in client.hkeys(k))
    # removed: 401 again everywhere
    assert admin.delete("/keys", params={"key": key}).status_code == 200
    assert admin.delete("/keys", params={"key": key}).status_code == 404
    for gateway in (a, b):
        _until_status(gateway, key, 401)


def test_a_bad_write_is_a_400_naming_the_problem_and_changes_nothing(
        pair: tuple[GatewayProcess, GatewayProcess, RedisProcess]) -> None:
    a, _, _ = pair
    with httpx.Client(base_url=a.admin_url) as admin:
        _bad_writes(a, admin)


def _bad_writes(a: GatewayProcess, admin: httpx.Client) -> None:
    def refused(answer: httpx.Response, field: str) -> bool:
        return (answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json"
                and answer.json()["field"] == field)

    assert refused(admin.put("/keys", params={"key": "k1"}, json={"plan": "gold"}), "plan")
    assert refused(admin.put("/keys", params={"key": " "}, json={"plan": "free"}), "key")
    assert refused(admin.put("/keys", params={"key": "x" * 1025}, json={"plan": "free"}), "key")
    assert refused(admin.put("/keys", params={"key": "k1"}, json={"plan": "free", "more": 1}), "plan")
    assert admin.get("/keys", params={"key": "k1"}).status_code == 404
    bulk = {"keys": [{"key": "b1", "plan": "free"}, {"key": "b2", "plan": "pro"}, {"key": "b3", "plan": "gold"}]}
    assert refused(admin.post("/keys", json=bulk), "keys[2].plan")
    assert [admin.get("/keys", params={"key": k}).status_code for k in ("b1", "b2")] == [404, 404]  # none
    assert refused(admin.post("/keys", json={"keys": [{"key": "b", "plan": "free"}] * 10_001}), "keys")
    big = admin.post("/keys", content=b'{"keys": [' + b" " * (3 * 1024 * 1024) + b"]}")
    assert big.status_code == 413 and "at most" in big.json()["detail"]
    bulk["keys"][2]["plan"] = "pro"
    assert admin.post("/keys", json=bulk).json() == {"written": 3}  # all of them
    assert [admin.get("/keys", params={"key": k}).json()["plan"] for k in ("b1", "b2", "b3")] == ["free", "pro", "pro"]
    wait_until(lambda: _status(a, "b1") == 200, timeout=APPLIES_WITHIN)


def test_unknown_pass_gives_the_plan_none(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    config = CONFIG.format(prefix=f"p{uuid.uuid4().hex[:8]}", upstream=upstream.url, unknown="pass")
    gateway = GatewayProcess(config.replace("plan: pro}", "plan: [pro, none]}"), tmp_path, redis_url=redis_proc.url)
    gateway.start()
    try:
        assert _rule(gateway, "nobody-" + uuid.uuid4().hex) == "pro-minute"  # `none` matched, with pro
    finally:
        assert gateway.stop() == 0


MIDDLEWARE_CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "query:api_key", plans: [free, pro]}}
routes:
  - name: pro
    match: {{path: /data, plan: pro}}
  - name: free
    match: {{path: /data}}
    limits: [{{name: per-key, by: ["query:api_key"], algorithm: fixed_window, limit: 1, window: 1h}}]
"""


def test_the_middleware_follows_keys_registered_elsewhere(tmp_path: Path, redis_proc: RedisProcess) -> None:
    """An app guarded in-process reads the keys a gateway's admin port registered in the same Redis."""
    import asyncio

    from starlette.types import Receive, Scope, Send

    from gateway import RateLimitMiddleware
    from gateway.api_keys import KeyStore
    from gateway.config import RedisSettings
    from gateway.limiter import Limiter
    from gateway.overrides import Store
    from gateway.redis import make_runner

    prefix = f"m{uuid.uuid4().hex[:8]}"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data"})

    config = tmp_path / "routes.yaml"
    config.write_text(MIDDLEWARE_CONFIG.format(prefix=prefix))

    async def register(key: str, plan: str) -> None:  # as a gateway's PUT /keys does
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=2.0)))
        await KeyStore(limiter, prefix).write({digest(key.encode()): plan})
        await Store(limiter, prefix).changed()
        await limiter.close()

    async def main() -> list[int]:
        guarded = RateLimitMiddleware(app, config=str(config), redis_url=redis_proc.url)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://app") as client:
                statuses = [(await client.get("/data", params={"api_key": "k1"})).status_code]  # unknown
                await register("k1", "free")
                await register("k2", "pro")
                for _ in range(40):  # within the sync's second (and some)
                    if (await client.get("/data", params={"api_key": "k2"})).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                statuses += [(await client.get("/data", params={"api_key": key})).status_code
                             for key in ("k1", "k1", "k2", "k2", "k2")]
                return statuses
        finally:
            await guarded.close()

    assert asyncio.run(main()) == [401, 200, 429, 200, 200, 200]  # free: 1 an hour; pro: no limit
