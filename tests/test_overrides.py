"""Per-identity overrides at runtime (PUT/GET/DELETE /overrides on the admin port), end to end: real
gateway processes on one real Redis, a real upstream (SPEC §2 "Per-identity overrides", §5)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import RedisSettings, parse_config
from gateway.keys import identity_token
from gateway.limiter import Limiter, rule_spec
from gateway.overrides import Store, canonical, entry
from gateway.plan import route_plan
from gateway.redis import make_runner
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until
from tests.test_middleware import Served

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

APPLIES_WITHIN = 2.0  # seconds: the SPEC's promise for every gateway

ROUTES = """\
version: 1
redis: {{key_prefix: {prefix}}}
admin: {{token: {token}}}
local_refusals: {{max_hold: 60s}}   # a refusal held in memory must not outlive an override
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api
    match: {{path: "/{{rest:path}}"}}
    upstream: up
    headers: legacy
    limits:
{rules}
"""
USER_RULE = "      - {name: user, by: [header:X-User], algorithm: fixed_window, limit: 2, window: 1h, max_overrides: 3}"


def routes(upstream: Upstream, prefix: str, token: str = '""', rules: str = USER_RULE) -> str:
    return ROUTES.format(prefix=prefix, token=token, upstream=upstream.url, rules=rules)


def ask(gateway: GatewayProcess, user: str) -> httpx.Response:
    return httpx.get(gateway.url + "/x", headers={"X-User": user}, timeout=5)


def answers(gateway: GatewayProcess, user: str, status: int) -> Callable[[], bool]:
    return lambda: ask(gateway, user).status_code == status


def admitted(gateway: GatewayProcess, user: str, tries: int) -> int:
    return sum(ask(gateway, user).status_code == 200 for _ in range(tries))


def put(gateway: GatewayProcess, key: str, body: Any, rule: str = "user", **headers: str) -> httpx.Response:
    return httpx.put(f"{gateway.admin_url}/overrides/api/{rule}", params={"key": key}, json=body,
                     headers=headers, timeout=5)


@pytest.fixture
def pair(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[tuple[GatewayProcess, ...]]:
    text = routes(upstream, f"o{uuid.uuid4().hex[:8]}")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    gateways = tuple(GatewayProcess(text, tmp_path / name, redis_url=redis_proc.url) for name in ("a", "b"))
    try:
        for gateway in gateways:
            gateway.start()
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()


@pytest.fixture(scope="module")
def one_gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
                upstream: Upstream) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(routes(upstream, f"o{uuid.uuid4().hex[:8]}"), tmp_path_factory.mktemp("one"),
                             redis_url=redis_proc.url)
    try:
        gateway.start()
        yield gateway
    finally:
        gateway.stop()


def test_an_override_applies_on_every_gateway_within_2s_and_survives_a_restart(
        pair: tuple[GatewayProcess, GatewayProcess]) -> None:
    a, b = pair
    assert admitted(a, "alice", 3) == 2 and admitted(b, "alice", 1) == 0   # the file's 2 per hour, held
    answer = put(a, "alice", {"limit": 5, "window": "1h"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["override"] == {"limit": 5, "window": "1h"}
    for gateway in (a, b):  # refused (from memory, too) until the override applies, then admitted
        wait_until(answers(gateway, "alice", 200), timeout=APPLIES_WITHIN)
    assert admitted(a, "alice", 3) + admitted(b, "alice", 3) == 1      # 5 in all: 2, then 1 + 1 + 1
    refused = ask(b, "alice")
    assert refused.status_code == 429 and refused.headers["x-ratelimit-limit"] == "5"
    assert admitted(a, "bob", 3) == 2                                   # others keep the file's numbers
    state = httpx.get(f"{b.admin_url}/limits/api/user", params={"key": "alice"}).json()
    assert (state["limit"], state["remaining"], state["override"]) == (5, 0, "numbers")

    assert put(b, "carol", {"limit": 4, "window": "1h"}).status_code == 200
    b.stop()
    b.start()
    assert admitted(b, "carol", 6) == 4                                 # read before the first request
    listed = httpx.get(f"{b.admin_url}/overrides/api/user", params={"key": "carol"}).json()
    assert listed["override"] == {"limit": 4, "window": "1h"}
    assert httpx.post(f"{b.admin_url}/reload").status_code == 200       # and a reload: in force at once
    after = ask(b, "carol")
    assert after.status_code == 429 and after.headers["x-ratelimit-limit"] == "4"


def test_unlimited_lets_one_identity_past_the_rule_and_delete_ends_it(
        pair: tuple[GatewayProcess, GatewayProcess]) -> None:
    a, b = pair
    assert admitted(a, "dave", 3) == 2
    assert put(a, "dave", {"unlimited": True}).status_code == 200
    wait_until(lambda: ask(b, "dave").status_code == 200, timeout=APPLIES_WITHIN)
    assert admitted(b, "dave", 10) == 10 and admitted(a, "dave", 10) == 10
    gone = httpx.delete(f"{a.admin_url}/overrides/api/user", params={"key": "dave"})
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    for gateway in (a, b):  # the file's 2 again, spent before: an unlimited identity's requests count nowhere
        wait_until(answers(gateway, "dave", 429), timeout=APPLIES_WITHIN)
    assert admitted(a, "dave", 3) + admitted(b, "dave", 3) == 0
    assert httpx.delete(f"{a.admin_url}/overrides/api/user", params={"key": "dave"}).status_code == 404


def test_overrides_per_rule_are_bounded_by_max_overrides(pair: tuple[GatewayProcess, GatewayProcess]) -> None:
    a, _ = pair
    body = {"limit": 9, "window": "1m"}
    assert [put(a, user, body).status_code for user in ("u1", "u2", "u3")] == [200, 200, 200]
    full = put(a, "u4", body)
    assert full.status_code == 409 and full.headers["content-type"] == "application/problem+json"
    assert "max_overrides (3)" in full.json()["detail"]
    assert put(a, "u2", {"limit": 10, "window": "1m"}).status_code == 200   # replacing one is no new one
    assert httpx.delete(f"{a.admin_url}/overrides/api/user", params={"key": "u1"}).status_code == 200
    assert put(a, "u4", body).status_code == 200
    summary = httpx.get(f"{a.admin_url}/overrides").json()["rules"]
    assert summary == [{"route": "api", "rule": "user", "algorithm": "fixed_window", "overrides": 3,
                        "max_overrides": 3}]
    seen, cursor = {}, None
    while True:
        page = httpx.get(f"{a.admin_url}/overrides/api/user",
                         params={"limit": 1, **({"cursor": cursor} if cursor else {})}).json()
        seen.update({item["key"]: item["override"] for item in page["overrides"]})
        cursor = page["next_cursor"]
        if cursor is None:
            break
    # listed by the user id as it came (its key in Redis is a digest, which key= also takes)
    assert seen == {"u2": {"limit": 10, "window": "1m"}, "u3": body, "u4": body}
    fp = {user: identity_token([user.encode()], readable=False) for user in ("u2", "u3", "u4")}
    everything, cursor = [], "0.0"
    while cursor is not None:
        page = httpx.get(f"{a.admin_url}/overrides", params={"limit": 2, "cursor": cursor}).json()
        everything += page["overrides"]
        cursor = page["next_cursor"]
    assert sorted(item["key"] for item in everything) == ["u2", "u3", "u4"]
    assert sorted(item["token"] for item in everything) == sorted(fp.values())
    assert httpx.get(f"{a.admin_url}/overrides/api/user", params={"key": fp["u3"]}).json()["override"] == body
    assert {(item["route"], item["rule"]) for item in everything} == {("api", "user")}


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"limit": "lots", "window": "1h"}, "limit", "must be a whole number"),
    ({"limit": 0, "window": "1h"}, "limit", "outside 1..1000000000"),
    ({"limit": 5}, "window", "is required by fixed_window"),
    ({"limit": 5, "window": "1h", "rate": "5/s"}, "rate", "is not a parameter of fixed_window"),
    ({"limit": 5, "window": "soon"}, "window", "must be a duration"),
    ({"limit": 5, "window": "0.1ms"}, "window", "1ms to 100 years"),
    # int() reads these as 50, and 1 == True to Python; no operator writes them so (an outside probe)
    ({"limit": "5_0", "window": "1h"}, "limit", "digits 0-9"),
    ({"limit": "+50", "window": "1h"}, "limit", "digits 0-9"),
    ({"limit": "\u0665\u0660", "window": "1h"}, "limit", "digits 0-9"),
    ({"unlimited": 1}, "unlimited", "must be true"),
    ({"unlimited": False}, "unlimited", "must be true"),
    ({"unlimited": True, "limit": 5}, "unlimited", "alone"),
    ([5, "1h"], None, "JSON object"),
])
def test_an_invalid_override_is_a_400_naming_its_field(one_gateway: GatewayProcess, body: Any,
                                                      field: str | None, words: str) -> None:
    a = one_gateway  # shared by the cases: an invalid override stores nothing
    answer = put(a, "erin", body)
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["field"] == field and words in problem["detail"], problem
    assert httpx.get(f"{a.admin_url}/overrides/api/user", params={"key": "erin"}).status_code == 404


def test_the_key_and_the_place_of_an_override_are_checked(pair: tuple[GatewayProcess, GatewayProcess]) -> None:
    a, _ = pair
    body = {"limit": 5, "window": "1h"}
    assert httpx.put(f"{a.admin_url}/overrides/api/user", json=body).status_code == 400  # no key=
    assert httpx.put(f"{a.admin_url}/overrides/api/user", content=b"{", params={"key": "x"}).status_code == 400
    assert put(a, "x", body, rule="nope").status_code == 404
    assert httpx.put(f"{a.admin_url}/overrides/nope/user", params={"key": "x"}, json=body).status_code == 404


def test_override_writes_need_the_admin_token(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    gateway = GatewayProcess(routes(upstream, f"o{uuid.uuid4().hex[:8]}", token="s3cret"), tmp_path,
                             redis_url=redis_proc.url)
    gateway.start()
    try:
        body = {"limit": 5, "window": "1h"}
        assert put(gateway, "frank", body).status_code == 401
        assert httpx.delete(f"{gateway.admin_url}/overrides/api/user", params={"key": "frank"}).status_code == 401
        assert put(gateway, "frank", body, Authorization="Bearer s3cret").status_code == 200
    finally:
        gateway.stop()


def test_overrides_of_a_rule_removed_from_the_file_are_dropped(tmp_path: Path, redis_proc: RedisProcess,
                                                               upstream: Upstream) -> None:
    prefix = f"o{uuid.uuid4().hex[:8]}"
    other = "      - {name: other, by: [header:X-User], algorithm: quota, limit: 100}"
    gateway = GatewayProcess(routes(upstream, prefix, rules=f"{USER_RULE}\n{other}"), tmp_path,
                             redis_url=redis_proc.url)
    gateway.start()
    try:
        assert put(gateway, "gina", {"limit": 7, "window": "1h"}).status_code == 200
        assert put(gateway, "gina", {"limit": 1000}, rule="other").status_code == 200
        gateway.config_path.write_text(routes(upstream, prefix, rules=other))
        assert httpx.post(f"{gateway.admin_url}/reload").status_code == 200
        client = redis_proc.client()
        wait_until(lambda: not client.exists(f"{prefix}:{{api}}:user:~overrides"), timeout=5)
        client.close()
        gateway.config_path.write_text(routes(upstream, prefix, rules=f"{USER_RULE}\n{other}"))
        assert httpx.post(f"{gateway.admin_url}/reload").status_code == 200
        counts = {r["rule"]: r["overrides"] for r in httpx.get(f"{gateway.admin_url}/overrides").json()["rules"]}
        assert counts == {"user": 0, "other": 1}                       # the rule kept keeps its override
        assert admitted(gateway, "gina", 3) == 2                        # the file's numbers again
    finally:
        gateway.stop()


def test_a_split_rule_s_override_is_split_over_the_shards_as_the_file_s_is() -> None:
    config = parse_config("""
version: 1
routes:
  - name: r
    match: {path: /}
    shards: 3
    limits:
      - {name: user, by: [header:X-User], algorithm: token_bucket, rate: 3/s, burst: 3}
      - {name: all, by: [], algorithm: sliding_window, limit: 30, window: 1s}
""", "routes.yaml", {}, proxy=False)
    plan = route_plan(config.routes[0], "p", None)
    overridden = entry(plan, 1, '{"limit": 100, "window": "1s"}')
    assert overridden.rule is not None
    assert [spec.p1 for spec in overridden.specs] == [34, 33, 33]               # 100 in all, never more
    assert all(spec.base == plan.shard_args[s][1] for s, spec in enumerate(overridden.specs))
    whole = entry(plan, 0, '{"rate": "30/s", "burst": 10}')                     # per identity: whole
    assert [spec.p1 for spec in whole.specs] == [10, 10, 10]
    assert whole.rule is not None and whole.specs[0]._replace(base=None) == rule_spec(whole.rule)


def test_an_app_guarded_in_process_applies_the_overrides_of_its_redis(tmp_path: Path, redis_proc: RedisProcess) -> None:
    served = Served("starlette_app", tmp_path, redis_proc.url)
    try:
        [config_file] = tmp_path.glob("routes-*.yaml")
        prefix = parse_config(config_file.read_text(), str(config_file), {}, proxy=False).redis.key_prefix

        def order(n: int) -> int:
            return served.client.post(f"/orders/{n}", content=f"o{n}".encode(), headers={"X-User": "hana"}).status_code

        assert [order(n) for n in range(4)] == [200, 200, 200, 429]       # the file's 3 an hour

        async def put() -> None:  # as a gateway's admin port sharing this Redis does
            limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=5.0)))
            hana = identity_token([b"hana"], readable=False)
            await Store(limiter, prefix).put("orders", "user", hana, canonical({"limit": 5, "window": "1h"}), 10)
            await limiter.close()

        asyncio.run(put())
        wait_until(lambda: order(10) == 200, timeout=APPLIES_WITHIN)
        assert [order(n) for n in range(11, 13)] == [200, 429]            # 5 in all
    finally:
        assert "Traceback" not in served.stop()


def test_an_override_on_the_embedded_redis_without_data_dir_says_it_will_not_survive(
        tmp_path: Path, upstream: Upstream) -> None:
    """Issue 33: overrides set on `make run` were gone after a restart and the answer did not say
    so. With the embedded Redis started --ephemeral the PUT says it (and the log); kept, it does not."""
    config = routes(upstream, f"o{uuid.uuid4().hex[:8]}")
    for data_dir in (None, tmp_path / "state"):
        workdir = tmp_path / ("volatile" if data_dir is None else "kept")
        workdir.mkdir()
        args = ("--data-dir", str(data_dir)) if data_dir is not None else ("--ephemeral",)
        gateway = GatewayProcess(config, workdir, args=args)
        gateway.start()
        try:
            answer = put(gateway, "erin", {"limit": 5, "window": "1h"})
            assert answer.status_code == 200, answer.text
            if data_dir is None:
                assert answer.json()["survives_restart"] is False
                assert "--ephemeral" in answer.json()["warning"]
            else:
                assert "warning" not in answer.json()
        finally:
            gateway.stop()
        if data_dir is None:
            assert "gone when the gateway stops" in gateway.log()
