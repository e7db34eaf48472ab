"""One fingerprint for every secret, everything else as it came: an API key refused is `kf_...` in
the access log, /top, /limits and /overrides, the same `kf_...` that /keys shows, and every `key=`
takes it; a user id, an address, a path parameter is shown as the client sent it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.api_keys import digest, fingerprint
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
access_log: true
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "header:X-Api-Key", unknown: pass, plans: [free]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api
    match: {{path: /echo/api}}
    upstream: up
    limits: [{{name: per-key, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 2, window: 1h}}]
  - name: users
    match: {{path: /echo/users}}
    upstream: up
    limits: [{{name: per-user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 1, window: 1h}}]
  - name: tenants
    match: {{path: /echo/tenants}}
    upstream: up
    limits: [{{name: per-tenant, by: [{{header: X-Tenant, secret: true}}], algorithm: fixed_window, limit: 1,
               window: 1h}}]
  - name: sessions
    match: {{path: /echo/sessions}}
    upstream: up
    limits: [{{name: per-session, by: ["cookie:session_id"], algorithm: fixed_window, limit: 1, window: 1h}}]
  - name: bearer
    match: {{path: /echo/bearer}}
    upstream: up
    limits: [{{name: per-token, by: ["header:Authorization"], algorithm: fixed_window, limit: 1, window: 1h}}]
  - name: authors
    match: {{path: /echo/authors}}
    upstream: up
    limits: [{{name: per-author, by: [{{header: X-Auth-User, secret: false}}], algorithm: fixed_window, limit: 1,
               window: 1h}}]
  - name: items
    match: {{path: "/echo/items/{{item}}"}}
    upstream: up
    limits: [{{name: per-item, by: ["path:item", "header:X-User-Id"], algorithm: fixed_window, limit: 1, window: 1h}}]
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    config = CONFIG.format(prefix=f"f{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    process = GatewayProcess(config, Path(tmp_path_factory.mktemp("fingerprints")), redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _refused_once(gateway: GatewayProcess, path: str, **sent: dict[str, str]) -> None:
    statuses: list[int] = []
    while not statuses or statuses[-1] == 200:
        statuses.append(httpx.get(gateway.url + path, **sent).status_code)  # type: ignore[arg-type]
        assert len(statuses) < 5, statuses
    assert statuses[-1] == 429, statuses


def _top(gateway: GatewayProcess, route: str) -> list[str]:
    answer = httpx.get(gateway.admin_url + "/top", params={"route": route, "window": "5m"}).json()
    return [entry["identity"] for entry in answer["top"]]


def _logged(gateway: GatewayProcess, route: str) -> list[str]:
    lines = [json.loads(line) for line in gateway.out_path.read_text().splitlines() if line.startswith("{")]
    return [line["identity"] for line in lines if line.get("route") == route and line["decision"] == "refused"]


def test_an_api_key_is_one_fingerprint_everywhere_and_every_key_takes_it(gateway: GatewayProcess) -> None:
    key = "sk_live_" + uuid.uuid4().hex
    mark = fingerprint(digest(key.encode()))
    with httpx.Client(base_url=gateway.admin_url) as admin:
        assert admin.put("/keys", params={"key": key}, json={"plan": "free"}).json()["key"] == mark
        _refused_once(gateway, "/echo/api", headers={"X-Api-Key": key})
        wait_until(lambda: mark in _top(gateway, "api"), timeout=5)
        wait_until(lambda: mark in _logged(gateway, "api"), timeout=5)
        # the fingerprint names the exhausted counter, not a fresh one
        by_mark = admin.get("/limits/api/per-key", params={"key": mark}).json()
        by_key = admin.get("/limits/api/per-key", params={"key": key}).json()
        assert by_mark["remaining"] == by_key["remaining"] == 0 and by_mark["exhausted"], by_mark
        assert by_mark["identity"] == by_key["identity"] == mark
        # an override by the fingerprint applies to the key, and is listed by it
        put = admin.put("/overrides/api/per-key", params={"key": mark}, json={"limit": 10, "window": "1h"})
        assert put.status_code == 200 and put.json()["key"] == mark, put.text
        listed = admin.get("/overrides/api/per-key").json()["overrides"]
        assert [entry["key"] for entry in listed] == [mark]
        assert mark in [entry["key"] for entry in admin.get("/overrides").json()["overrides"]]
        wait_until(lambda: httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": key}).status_code == 200,
                   timeout=3)
        assert admin.delete("/overrides/api/per-key", params={"key": key}).status_code == 200
        assert admin.delete("/limits/api/per-key", params={"key": mark}).json()["reset"] is True
    assert key not in gateway.log() and key not in gateway.out_path.read_text()


@pytest.mark.parametrize(("path", "route", "sent", "value", "secret"), [
    ("/echo/tenants", "tenants", {"headers": {"X-Tenant": "acme-corp"}}, "acme-corp", True),
    ("/echo/sessions", "sessions", {"cookies": {"session_id": "s3cr3t-session"}}, "s3cr3t-session", True),
    ("/echo/bearer", "bearer", {"headers": {"Authorization": "Bearer tok-123"}}, "Bearer tok-123", True),
    ("/echo/users", "users", {"headers": {"X-User-Id": "alice@example.com"}}, "alice@example.com", False),
    ("/echo/authors", "authors", {"headers": {"X-Auth-User": "batch"}}, "batch", False),
])
def test_secrets_are_fingerprinted_and_user_ids_shown_as_they_came(
        gateway: GatewayProcess, path: str, route: str, sent: dict[str, dict[str, str]], value: str,
        secret: bool) -> None:
    value = f"{value}-{uuid.uuid4().hex[:6]}"
    for where in sent.values():
        for name in where:
            where[name] = value
    shown = fingerprint(digest(value.encode())) if secret else value
    _refused_once(gateway, path, **sent)
    wait_until(lambda: shown in _top(gateway, route), timeout=5)
    wait_until(lambda: shown in _logged(gateway, route), timeout=5)
    rule = httpx.get(gateway.admin_url + "/limits").json()
    rule_name = next(r["rules"][0]["name"] for r in rule["routes"] if r["name"] == route)
    with httpx.Client(base_url=gateway.admin_url) as admin:
        for key in {shown, value}:
            state = admin.get(f"/limits/{route}/{rule_name}", params={"key": key}).json()
            assert state["remaining"] == 0 and state["identity"] == shown, state
        assert admin.put(f"/overrides/{route}/{rule_name}", params={"key": shown},
                         json={"limit": 3, "window": "1h"}).json()["key"] == shown
        listed = [entry["key"] for entry in admin.get(f"/overrides/{route}/{rule_name}").json()["overrides"]]
        assert shown in listed
    if secret:
        assert value not in gateway.log() + gateway.out_path.read_text()
        assert value not in json.dumps(_top(gateway, route))


def test_several_parts_are_shown_joined_and_taken_back(gateway: GatewayProcess) -> None:
    user = f"bob-{uuid.uuid4().hex[:6]}"
    _refused_once(gateway, "/echo/items/42", headers={"X-User-Id": user})
    wait_until(lambda: f"42:{user}" in _top(gateway, "items"), timeout=5)
    state = httpx.get(gateway.admin_url + "/limits/items/per-item", params={"key": f"42:{user}"}).json()
    assert state["remaining"] == 0 and state["identity"] == f"42:{user}"
