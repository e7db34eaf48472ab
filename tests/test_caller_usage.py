"""`respond: usage` (gateway/caller_usage.py, issue 30): the caller's own usage of every rule it is
counted by, read in one script call that charges nothing, through the proxy and the middleware."""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

# the file of each test: a usage route first, then the routes it reports
USAGE_FIRST = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: usage
    match: {{path: /rate_limit, methods: [GET]}}
    respond: usage
"""
CONFIG = USAGE_FIRST + """\
    limits: [{{name: polls, by: [ip], algorithm: fixed_window, limit: 100, window: 1m}}]
  - name: search
    match: {{path: "/echo/search"}}
    upstream: up
    limits:
      - {{name: per-key, by: ["header:X-Api-Key"], algorithm: quota, limit: 10, period: 1d}}
      - {{name: per-ip, by: [ip], algorithm: token_bucket, rate: 1/s, burst: 50}}
  - name: orders
    match: {{path: "/echo/orders/{{item}}"}}
    upstream: up
    limits:
      - {{name: per-key, by: ["header:X-Api-Key"], algorithm: sliding_window, limit: 5, window: 1h}}
      - {{name: stock, by: ["path:item"], algorithm: quota, limit: 3}}
  - name: only-search
    match: {{path: /rate_limit/search}}
    respond: usage
    usage_of: [search]
"""


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(CONFIG.format(prefix=f"u{uuid.uuid4().hex[:8]}", upstream=upstream.url), tmp_path,
                          redis_url=redis_proc.url)
    proc.start()
    yield proc
    assert proc.stop() == 0


Usage = dict[tuple[str, str], dict[str, Any]]


def _usage(client: httpx.Client, path: str = "/rate_limit", key: str | None = None) -> Usage:
    answer = client.get(path, headers={"X-Api-Key": key} if key else {})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    return {(row["route"], row["rule"]): row for row in answer.json()["usage"]}


def test_the_callers_usage_of_every_rule_it_is_counted_by_charging_nothing(gateway: GatewayProcess) -> None:
    key = "k-" + uuid.uuid4().hex
    with httpx.Client(base_url=gateway.url) as client:
        for _ in range(3):
            assert client.get("/echo/search", headers={"X-Api-Key": key}).status_code == 200
        assert client.post("/echo/orders/1", headers={"X-Api-Key": key}).status_code == 200
        seen = _usage(client, key=key)
        # its key's rules and its address's; the stock rule's identity (an item) is not in this request
        assert set(seen) == {("search", "per-key"), ("search", "per-ip"), ("orders", "per-key")}
        assert (seen["search", "per-key"]["limit"], seen["search", "per-key"]["remaining"]) == (10, 7)
        assert 0 < seen["search", "per-key"]["reset_ms"] <= 86_400_000
        assert (seen["orders", "per-key"]["limit"], seen["orders", "per-key"]["remaining"]) == (5, 4)
        assert seen["search", "per-ip"]["limit"] == 50
        again = _usage(client, key=key)  # reading charged nothing
        assert again["search", "per-key"]["remaining"] == 7 and again["orders", "per-key"]["remaining"] == 4
        # without a key: the address's rules only
        assert set(_usage(client)) == {("search", "per-ip")}
        # usage_of: the routes it names
        assert set(_usage(client, "/rate_limit/search", key)) == {("search", "per-key"), ("search", "per-ip")}
        # its own limits count: polls are limited like any route
        answer = client.get("/rate_limit")
        assert answer.headers["ratelimit-policy"].startswith('"polls"')
        assert client.post("/rate_limit").status_code == 405  # GET only, as its match says


def test_a_usage_route_names_routes_of_the_file_and_has_no_upstream() -> None:
    text = textwrap.dedent("""\
        version: 1
        upstreams: {up: {url: "http://u:1"}}
        routes:
          - name: usage
            match: {path: /rate_limit}
            respond: usage
            upstream: up
            usage_of: [serch]
          - name: search
            match: {path: /search}
            upstream: up
            usage_of: [usage]
            limits: [{name: ip, by: [ip], algorithm: gcra, rate: 1/s, burst: 1}]
        """)
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":7: routes[0](usage).upstream: a respond: usage route answers itself" in s for s in shown), shown
    assert any(":8: routes[0](usage).usage_of: no route named 'serch' (did you mean search?)" in s
               for s in shown), shown
    assert any(":12: routes[1](search).usage_of: only a respond: usage route reports usage" in s for s in shown), shown


MIDDLEWARE_CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
routes:
  - name: usage
    match: {{path: /rate_limit}}
    respond: usage
  - name: api
    match: {{path: /api}}
    limits: [{{name: per-user, by: ["header:X-User"], algorithm: fixed_window, limit: 4, window: 1h}}]
"""


def test_the_middleware_answers_usage_itself(tmp_path: Path, redis_proc: RedisProcess) -> None:
    import asyncio

    from starlette.types import Receive, Scope, Send

    from gateway import RateLimitMiddleware

    called: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        called.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    config = tmp_path / "routes.yaml"
    config.write_text(MIDDLEWARE_CONFIG.format(prefix=f"m{uuid.uuid4().hex[:8]}"))

    async def main() -> dict[str, Any]:
        guarded = RateLimitMiddleware(app, config=str(config), redis_url=redis_proc.url)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://app") as client:
                for _ in range(3):
                    assert (await client.get("/api", headers={"X-User": "ann"})).text == "app"
                answer = await client.get("/rate_limit", headers={"X-User": "ann"})
                assert answer.status_code == 200
                return dict(answer.json())
        finally:
            await guarded.close()

    usage = asyncio.run(main())
    assert usage == {"usage": [{"route": "api", "rule": "per-user", "limit": 4, "remaining": 1,
                                "reset_ms": usage["usage"][0]["reset_ms"]}]}
    assert called == ["/api"] * 3  # the app never saw the usage request


RLS_CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: usage
    match: {{path: /rate_limit}}
    respond: usage
  - name: search
    match: {{path: "/echo/search"}}
    upstream: up
    limits: [{{name: per-ip, by: [ip], algorithm: fixed_window, limit: 10, window: 1h}}]
rls:
  domains:
    edge:
      descriptors:
        - key: remote_address
          limit: {{name: per_ip, algorithm: token_bucket, rate: 10/s, burst: 40}}
"""


def test_usage_beside_an_rls_domain_reports_the_http_routes(tmp_path: Path, redis_proc: RedisProcess,
                                                              upstream: Upstream) -> None:
    # an RLS domain's rules are keyed by the descriptors Envoy sends, which an HTTP request does not
    # carry: the usage route reports the HTTP routes only (it answered 500 here)
    text = RLS_CONFIG.format(prefix=f"r{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    proc = GatewayProcess(text, tmp_path, redis_url=redis_proc.url)
    proc.start()
    try:
        with httpx.Client(base_url=proc.url) as client:
            assert client.get("/echo/search").status_code == 200
            seen = _usage(client)
            assert set(seen) == {("search", "per-ip")} and seen["search", "per-ip"]["remaining"] == 9
    finally:
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


WHO_CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "header:X-Api-Key", unknown: pass, plans: [free, pro]}}
upstreams: {{up: {{url: "{upstream}"}}}}
shared:
  - {{name: per-key-day, by: ["header:X-Api-Key"], algorithm: quota, limit: 1000, period: 1d}}
routes:
  - name: usage
    match: {{path: /rate_limit}}
    respond: usage
  - name: internal
    match: {{path: "/echo/admin", client: [10.0.0.0/8]}}
    upstream: up
    limits: [{{name: staff, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 9, window: 1h}}]
  - name: search-pro
    match: {{path: "/echo/search", plan: pro}}
    upstream: up
    limits:
      - {{use: per-key-day}}
      - {{name: pro-minute, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 100, window: 1m}}
  - name: search
    match: {{path: "/echo/search"}}
    upstream: up
    limits:
      - {{use: per-key-day}}
      - {{name: free-minute, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 5, window: 1m}}
  - name: docs-read
    match: {{path: "/echo/docs", methods: [GET]}}
    upstream: up
  - name: docs                      # never matched: the route above owns its path
    match: {{path: "/echo/docs"}}
    upstream: up
    limits: [{{name: docs-any, by: [ip], algorithm: fixed_window, limit: 3, window: 1h}}]
  - name: beta
    match: {{path: "/echo/beta", headers: {{X-Beta: [yes]}}}}
    upstream: up
    limits:
      - {{use: per-key-day}}
      - {{name: testers, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 7, window: 1h}}
"""


def test_usage_lists_only_routes_the_caller_could_match_and_a_shared_rule_once(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    text = WHO_CONFIG.format(prefix=f"w{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    proc = GatewayProcess(text, tmp_path, redis_url=redis_proc.url)
    proc.start()
    free, pro = "free-" + uuid.uuid4().hex, "pro-" + uuid.uuid4().hex
    try:
        with httpx.Client(base_url=proc.admin_url) as admin:
            for key, plan in ((free, "free"), (pro, "pro")):
                assert admin.put("/keys", params={"key": key}, json={"plan": plan}).status_code == 200
        with httpx.Client(base_url=proc.url) as client:
            wait_until(lambda: client.get("/echo/search", headers={"X-Api-Key": pro}).headers
                       .get("ratelimit-policy", "").find("pro-minute") >= 0, timeout=5)
            assert client.get("/echo/search", headers={"X-Api-Key": free}).status_code == 200
            # a free caller from 127.0.0.1: neither the pro route nor the 10/8 one; the shared rule once
            seen = _rows(client, free)
            assert [(row["route"], row["rule"]) for row in seen] == [("search", "per-key-day"),
                                                                     ("search", "free-minute")]
            assert seen[0]["remaining"] == 999 and seen[0]["routes"] == ["search"]
            assert seen[1]["remaining"] == 4
            # a header the beta route asks for: that route too, its shared rule still once
            beta = _rows(client, free, {"X-Beta": "yes"})
            assert [(row["route"], row["rule"]) for row in beta] == [
                ("search", "per-key-day"), ("search", "free-minute"), ("beta", "testers")]
            assert beta[0]["routes"] == ["search", "beta"]
            # a pro caller: the pro route, not the free one it never reaches on the same path
            mine = _rows(client, pro)
            assert [(row["route"], row["rule"]) for row in mine] == [("search-pro", "per-key-day"),
                                                                     ("search-pro", "pro-minute")]
    finally:
        assert proc.stop() == 0


def _rows(client: httpx.Client, key: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    answer = client.get("/rate_limit", headers={"X-Api-Key": key, **(headers or {})})
    assert answer.status_code == 200, answer.text
    rows: list[dict[str, Any]] = answer.json()["usage"]
    return rows


BY_METHOD = USAGE_FIRST + """\
  - name: writes
    match: {{path: "/echo/writes", methods: [POST, PUT]}}
    upstream: up
    limits: [{{name: per-method, by: ["header:X-Api-Key", method], algorithm: quota, limit: 2}}]
  - name: anything
    match: {{path: "/echo/anything"}}
    upstream: up
    limits:
      - {{name: per-method, by: [method, "header:X-Api-Key"], algorithm: quota, limit: 2}}
      - {{name: per-key, by: ["header:X-Api-Key"], algorithm: quota, limit: 9}}
"""


def test_a_rule_keyed_by_method_is_shown_for_each_method_its_route_counts(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    """Before, the usage request's own GET was read as the method: a route taking POST showed a
    counter no request ever spent (2 left after two POSTs spent both, an outside probe found)."""
    proc = GatewayProcess(BY_METHOD.format(prefix=f"u{uuid.uuid4().hex[:8]}", upstream=upstream.url), tmp_path,
                          redis_url=redis_proc.url)
    proc.start()
    try:
        key = {"X-Api-Key": "k-" + uuid.uuid4().hex}
        with httpx.Client(base_url=proc.url) as client:
            assert [client.post("/echo/writes", headers=key).status_code for _ in range(3)] == [200, 200, 429]
            assert client.put("/echo/writes", headers=key).status_code == 200
            assert client.delete("/echo/anything", headers=key).status_code == 200
            rows = client.get("/rate_limit", headers=key).json()["usage"]
        shown = {(row["route"], row["rule"], row.get("method")): row["remaining"] for row in rows}
        # a route taking any method has no one counter per method to show; its other rules are shown
        assert shown == {("writes", "per-method", "POST"): 0, ("writes", "per-method", "PUT"): 1,
                         ("anything", "per-key", None): 8}
    finally:
        assert proc.stop() == 0
