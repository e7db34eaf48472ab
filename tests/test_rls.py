"""Envoy's rate limit service on the gateway's engine (SPEC section 7): the gateway a real process
with --rls-port and a real Redis, asked by grpcio's client (another HTTP/2 and gRPC than the
server's). Every case runs twice: on the gateway's own gRPC server (gateway/rls/server.py) on
libnghttp2, and on the same server on h2 (tests/support/rls_comparison.py), the HTTP/2 it replaced.

Cases named `test_<suite>_<case>` are envoyproxy/ratelimit's own (test/integration/integration_test.go,
test/config/config_test.go, test/service/ratelimit_test.go), ported as black-box calls against
files in that server's format; where the gateway answers differently on purpose, the test says so.
"""

from __future__ import annotations

import random
import signal
import textwrap
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import grpc
import httpx
import pytest
import yaml

from gateway.config import load_config
from gateway.decision_script import generic_script
from gateway.errors import ConfigError
from gateway.rls import messages as pb
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.rls_client import (
    DAY,
    HOUR,
    MINUTE,
    OK,
    OVER_LIMIT,
    SECOND,
    Descriptor,
    RlsClient,
    codes,
    decision_scripts,
    error_of,
    remaining,
    request,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

# envoyproxy/ratelimit's test/integration config (basic.yaml, another.yaml), written again
BASIC = """\
domain: basic
descriptors:
  - key: key1
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: one_per_minute
    rate_limit: {unit: minute, requests_per_unit: 1}
"""
ANOTHER = """\
domain: another
descriptors:
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 20}
"""
# test/config/basic_config.yaml's tree: key-only defaults, key_value overrides, whitelisted values
TEST_DOMAIN = """\
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    rate_limit: {unit: minute, requests_per_unit: 70}
    detailed_metric: true
"""
WILDCARD = """\
domain: wildcard
descriptors:
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: noWild
    value: foo
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: noVal
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: midWild
    value: bar*b
    rate_limit: {unit: minute, requests_per_unit: 20}
"""
SHADOW = """\
domain: shadow
descriptors:
  - key: key1
    rate_limit: {unit: minute, requests_per_unit: 2}
    shadow_mode: true
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 2}
"""
REPLACES = """\
domain: replaces
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 2, name: tenant_default}
  - key: vip
    rate_limit:
      unit: minute
      requests_per_unit: 100
      name: vip
      replaces: [{name: tenant_default}]
"""
# the issue's atomicity case: a per-user 3/min beside a per-site 5/min
SITE = """\
domain: site
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: site
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: never
    rate_limit: {unit: minute, requests_per_unit: 0}
"""
FILES = {"basic.yaml": BASIC, "another.yaml": ANOTHER, "test_domain.yaml": TEST_DOMAIN, "wildcard.yaml": WILDCARD,
         "shadow.yaml": SHADOW, "replaces.yaml": REPLACES, "site.yaml": SITE}
CONFIG = """\
version: 1
redis: {timeout: 250ms}
admin: {token: ""}
defaults: {headers: legacy}
rls:
  files: [basic.yaml, another.yaml, test_domain.yaml, wildcard.yaml, shadow.yaml, replaces.yaml, site.yaml]
  domains:
    native:
      descriptors:
        - key: user
          limit: {name: user_bucket, algorithm: token_bucket, rate: 1/min, burst: 3}
        - key: org
          limit: {name: org_window, algorithm: sliding_window, limit: 5, window: 1m}
          descriptors:
            - key: plan
              value: free
              limit: {name: free_plan, algorithm: gcra, rate: 2/min, burst: 2}
        - key: daily
          limit: {name: daily, algorithm: fixed_window, limit: 5, window: day, calendar: Europe/Berlin}
"""


def unique() -> str:
    return f"v{random.getrandbits(48):x}"


class Rls:
    def __init__(self, gateway: GatewayProcess, port: int, kind: str) -> None:
        self.gateway = gateway
        self.port = port
        self.kind = kind
        self.client = RlsClient(port)


def start_rls(tmp: Path, redis_url: str, files: dict[str, str], config: str, kind: str = "lean",
              workers: int = 1) -> Rls:
    for name, text in files.items():
        (tmp / name).write_text(text)
    port = free_port()
    gateway = GatewayProcess(config, tmp, redis_url=redis_url, workers=workers, args=("--rls-port", str(port)),
                             rls_server=kind)
    gateway.start()
    return Rls(gateway, port, kind)


@pytest.fixture(scope="module", params=["lean", "h2"])
def rls(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        redis_proc: RedisProcess) -> Iterator[Rls]:
    tmp = tmp_path_factory.mktemp(f"rls-{request.param}")
    server = start_rls(tmp, redis_proc.url, FILES, CONFIG, request.param)
    try:
        yield server
    finally:
        server.client.close()
        server.gateway.stop()


def limit_of(status: pb.RateLimitResponse.DescriptorStatus) -> tuple[int, int] | None:
    if not status.HasField("current_limit"):
        return None
    return status.current_limit.requests_per_unit, status.current_limit.unit


# --- test/integration/integration_test.go ---------------------------------------------------------

def test_integration_basic_config_unknown_domain_is_ok(rls: Rls) -> None:
    """A domain with no configuration: OK, no limit, for every descriptor."""
    response = rls.client.ask("foo", [("hello", "world")], [("a", "b")])
    assert response.overall_code == OK
    assert codes(response) == [OK, OK]
    assert [limit_of(s) for s in response.statuses] == [None, None]


def test_integration_basic_config_first_call(rls: Rls) -> None:
    response = rls.client.ask("basic", [("key1", unique())])
    assert response.overall_code == OK
    assert limit_of(response.statuses[0]) == (50, SECOND)
    assert remaining(response) == [49]


def test_integration_basic_config_over_limit_per_minute(rls: Rls) -> None:
    key = unique()
    for i in range(25):
        response = rls.client.ask("another", [("key2", key)])
        over = i >= 20
        assert response.overall_code == (OVER_LIMIT if over else OK), i
        assert limit_of(response.statuses[0]) == (20, MINUTE)
        assert remaining(response) == [0 if over else 20 - (i + 1)]


def test_integration_basic_config_two_keys_all_or_nothing(rls: Rls) -> None:
    """Two keys in one request, the second (10/hour) over after 10 calls. envoyproxy/ratelimit's
    own test expects key2 to go on counting down (20 - (i+1)) while key3 refuses (its #1060); here
    a refused request consumes nothing, so key2 stays at 10 once key3 is over."""
    key = unique()
    for i in range(15):
        response = rls.client.ask("another", [("key2", key)], [("key3", key)])
        over = i >= 10
        assert response.overall_code == (OVER_LIMIT if over else OK), i
        assert codes(response) == [OK, OVER_LIMIT if over else OK]
        if i <= 10:  # later refusals come from memory, which knows the refusing rule's state only
            assert remaining(response) == [20 - min(i + 1, 10), 0 if over else 10 - (i + 1)], i
        assert [limit_of(s) for s in response.statuses] == [(20, MINUTE), (10, HOUR)]
    assert remaining(rls.client.ask("another", Descriptor([("key2", key)], hits=0))) == [10]


def test_issue_atomicity_user_then_site(rls: Rls) -> None:
    """User A spends a per-user 3/min on descriptors (user, site 5/min) by sending 5: 3 pass, 2 are
    refused and consume nothing of the site. User B then gets exactly 2 (envoyproxy/ratelimit: 0)."""
    site = unique()
    answers = [rls.client.ask("site", [("user", "A" + site)], [("site", site)]).overall_code for _ in range(5)]
    assert answers == [OK, OK, OK, OVER_LIMIT, OVER_LIMIT]
    b = [rls.client.ask("site", [("user", "B" + site)], [("site", site)]) for _ in range(3)]
    assert [r.overall_code for r in b] == [OK, OK, OVER_LIMIT]
    assert codes(b[2]) == [OK, OVER_LIMIT]
    assert remaining(b[2]) == [1, 0]  # B's own user limit: 3 - 2, untouched by the refused call


# --- test/config/config_test.go: the tree's lookups, seen through current_limit -------------------

@pytest.mark.parametrize(("entries", "expected"), [
    ([("key1", "something")], None),                              # key1 has only key_value children
    ([("key1", "value1")], None),                                 # a node without a limit of its own
    ([("key2", "value2"), ("subkey", "subvalue")], None),         # deeper than the tree
    ([("key5", "value5"), ("subkey5", "subvalue")], None),        # no such value below key5
    ([("key1", "value1"), ("subkey1", "something")], (5, SECOND)),  # key-only default at level 2
    ([("key1", "value1"), ("subkey1", "subvalue1")], (10, SECOND)),  # key_value wins over key
    ([("key2", "something")], (20, MINUTE)),
    ([("key2", "value2")], (30, MINUTE)),
    ([("key2", "value3")], None),                                 # whitelisted: no limit
    ([("key3", "foo")], (1, HOUR)),
    ([("key4", "foo")], (1, DAY)),
    ([("key5", "value5")], (15, DAY)),
    ([("key5", "value5"), ("subkey5", "subvalue5")], (25, DAY)),
    ([("key7", "unspecified_value")], (70, MINUTE)),              # detailed_metric: counted as any other
])
def test_config_basic_config(rls: Rls, entries: list[tuple[str, str]], expected: tuple[int, int] | None) -> None:
    # a fresh identity each time: the limits are those of the tree, not of earlier calls
    entries = [(k, v + unique()) if v in ("something", "foo", "unspecified_value") else (k, v) for k, v in entries]
    response = rls.client.ask("test-domain", entries, hits=0 if expected in ((1, HOUR), (1, DAY)) else 1)
    assert limit_of(response.statuses[0]) == expected
    assert response.overall_code == OK


def test_config_basic_config_unlimited(rls: Rls) -> None:
    """`unlimited: true`: OK, no limit, the most that can remain (envoyproxy/ratelimit: MaxUint32)."""
    for _ in range(3):
        response = rls.client.ask("test-domain", [("key6", "foo")])
        assert codes(response) == [OK]
        assert remaining(response) == [2**32 - 1]


def test_config_wildcard_config(rls: Rls) -> None:
    ask = rls.client.ask
    assert limit_of(ask("wildcard", [("noVal", unique())]).statuses[0]) == (20, MINUTE)
    assert limit_of(ask("wildcard", [("wild", "foo1" + unique())]).statuses[0]) == (20, MINUTE)
    assert limit_of(ask("wildcard", [("wild", "foo")]).statuses[0]) == (20, MINUTE)
    assert limit_of(ask("wildcard", [("wild", "bar")]).statuses[0]) is None            # no match
    assert limit_of(ask("wildcard", [("noWild", "foo1")]).statuses[0]) is None         # no eager match
    assert limit_of(ask("wildcard", [("midWild", "barab")]).statuses[0]) is None       # * only at the end


def test_config_wildcard_values_count_apart(rls: Rls) -> None:
    """Each value a wildcard matches has its own count, as each value of a key-only entry does."""
    a, b = "foo" + unique(), "foo" + unique()
    for _ in range(20):
        assert rls.client.ask("wildcard", [("wild", a)]).overall_code == OK
    assert rls.client.ask("wildcard", [("wild", a)]).overall_code == OVER_LIMIT
    assert rls.client.ask("wildcard", [("wild", b)]).overall_code == OK


def test_config_limit_override(rls: Rls) -> None:
    """A descriptor's own `limit` replaces the configured one (only in a configured domain), counted
    per descriptor value; the response's current_limit is the descriptor's."""
    key = unique()
    own = Descriptor([("key1", "value1"), ("subkey1", key)], limit=(2, DAY))
    for i in range(3):
        response = rls.client.ask("test-domain", own)
        assert limit_of(response.statuses[0]) == (2, DAY)
        assert codes(response) == [OVER_LIMIT if i == 2 else OK]
    other = Descriptor([("key1", "value1"), ("subkey1", key + "else")], limit=(2, DAY))
    assert rls.client.ask("test-domain", other).overall_code == OK
    unknown = rls.client.ask("foo_domain", Descriptor([("a", "b")], limit=(1, DAY)))
    assert limit_of(unknown.statuses[0]) is None


def test_config_shadow_mode_config(rls: Rls) -> None:
    """A shadow_mode limit counts but never refuses: over it, OK with nothing remaining."""
    key = unique()
    answers = [rls.client.ask("shadow", [("key1", key)]) for _ in range(4)]
    assert [r.overall_code for r in answers] == [OK] * 4
    assert [remaining(r) for r in answers] == [[1], [0], [0], [0]]  # shadow: counted, never refused
    key = unique()
    answers = [rls.client.ask("shadow", [("key2", key)]) for _ in range(3)]
    assert [r.overall_code for r in answers] == [OK, OK, OVER_LIMIT]


def test_service_replaces(rls: Rls) -> None:
    """A matched limit that `replaces` another by name: the replaced one is not counted."""
    tenant = unique()
    for _ in range(5):  # tenant_default (2/min) alone would refuse the third
        response = rls.client.ask("replaces", [("tenant", tenant)], [("vip", tenant)])
        assert response.overall_code == OK
        assert limit_of(response.statuses[0]) is None
    assert rls.client.ask("replaces", [("tenant", tenant)]).overall_code == OK  # still 2 left
    assert rls.client.ask("replaces", [("tenant", tenant)]).overall_code == OK
    assert rls.client.ask("replaces", [("tenant", tenant)]).overall_code == OVER_LIMIT


def test_requests_per_unit_zero_refuses_everything(rls: Rls) -> None:
    response = rls.client.ask("site", [("never", unique())])
    assert response.overall_code == OVER_LIMIT
    assert limit_of(response.statuses[0]) == (0, MINUTE)


# --- hits_addend ------------------------------------------------------------------------------------

def test_hits_addend_of_the_request_and_of_a_descriptor(rls: Rls) -> None:
    key = unique()
    assert remaining(rls.client.ask("another", [("key2", key)], hits=5)) == [15]
    assert remaining(rls.client.ask("another", Descriptor([("key2", key)], hits=10), hits=5)) == [5]
    # a descriptor's hits_addend of 0 looks without counting
    assert remaining(rls.client.ask("another", Descriptor([("key2", key)], hits=0))) == [5]
    response = rls.client.ask("another", [("key2", key)], hits=6)
    assert response.overall_code == OVER_LIMIT
    assert remaining(rls.client.ask("another", [("key2", key)], hits=5)) == [0]


def test_the_same_descriptor_twice_counts_twice(rls: Rls) -> None:
    """Two descriptors of one key in one call are one count charged twice (one script call cannot
    read a key's state for two rules)."""
    key = unique()
    response = rls.client.ask("another", [("key2", key)], [("key2", key)])
    assert remaining(response) == [18, 18]
    assert remaining(rls.client.ask("another", [("key2", key)])) == [17]


# --- test/service/ratelimit_test.go: malformed calls ------------------------------------------------

@pytest.mark.parametrize(("body", "message"), [
    (request("", [("hello", "world")]), "domain must not be empty"),
    (request("test-domain"), "descriptors must not be empty"),
    (request("another", [("key2", "x")], []), "descriptors[1] has no entries"),
    (request("another", [("key2", "x")], [("", "v")]), "descriptors[1].entries[0] has an empty key"),
    (request("another", [("key2", "x")], [("key2", "v" * 1025)]), "identity.max_length"),
    (request("another", [("key2", "x")], hits=2_000_000_000), "hits_addend must be at most"),
    (request("no-such-domain", [("key", "x")], hits=2_000_000_000), "hits_addend must be at most"),
])
def test_service_malformed_calls_count_nothing(rls: Rls, body: pb.RateLimitRequest, message: str) -> None:
    key = unique()
    if body.descriptors:
        body.descriptors[0].entries[0].value = key
    status, details = error_of(lambda: rls.client.ask_raw(body.SerializeToString()))
    assert status is grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    if body.domain == "another":
        assert remaining(rls.client.ask("another", [("key2", key)])) == [19]  # nothing counted before


def test_service_not_a_message(rls: Rls) -> None:
    status, details = error_of(lambda: rls.client.ask_raw(b"\xff\xff\xff"))
    assert status is grpc.StatusCode.INVALID_ARGUMENT
    assert "RateLimitRequest" in details


def test_service_message_over_the_size_limit(rls: Rls) -> None:
    body = request("another", [("key2", "x" * 100)] * 700).SerializeToString()
    assert len(body) > 64 * 1024
    status, _ = error_of(lambda: rls.client.ask_raw(body))
    assert status is grpc.StatusCode.RESOURCE_EXHAUSTED  # the server's bound, on either HTTP/2


def test_unknown_method(rls: Rls) -> None:
    method = rls.client.channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/Nope")
    status, _ = error_of(lambda: method(b"", timeout=5))
    assert status is grpc.StatusCode.UNIMPLEMENTED


# --- the native form --------------------------------------------------------------------------------

def test_native_domain_rules_of_other_algorithms(rls: Rls) -> None:
    user = unique()
    answers = [rls.client.ask("native", [("user", user)]) for _ in range(4)]
    assert [r.overall_code for r in answers] == [OK, OK, OK, OVER_LIMIT]  # token bucket, burst 3
    assert answers[0].statuses[0].current_limit.name == "user_bucket"
    assert answers[0].statuses[0].current_limit.requests_per_unit == 3
    assert answers[3].statuses[0].duration_until_reset.seconds > 0
    org = unique()
    answers = [rls.client.ask("native", [("org", org), ("plan", "free")]) for _ in range(3)]
    assert [r.overall_code for r in answers] == [OK, OK, OVER_LIMIT]   # gcra 2/min below the org
    assert answers[0].statuses[0].current_limit.name == "free_plan"
    assert rls.client.ask("native", [("org", org)]).overall_code == OK  # sliding window: its own count


def test_a_calendar_day_resets_at_local_midnight(rls: Rls) -> None:
    """A native rule's calendar day ends at the zone's midnight (the script once knew only a period
    of the day's longest length, from the epoch)."""
    def to_midnight() -> float:
        now = datetime.now(ZoneInfo("Europe/Berlin"))
        midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), now.tzinfo)
        return midnight.timestamp() - now.timestamp()

    longest = to_midnight()
    status = rls.client.ask("native", [("daily", unique())]).statuses[0]
    shortest = to_midnight()
    assert status.code == OK and status.limit_remaining == 4
    reset = status.duration_until_reset.seconds + status.duration_until_reset.nanos / 1e9
    assert shortest - 1 <= reset <= longest + 1


def test_headers_as_defaults_headers_says(rls: Rls) -> None:
    key = unique()
    ok = rls.client.ask("another", [("key2", key)], hits=19)
    headers = {h.key: h.value for h in ok.response_headers_to_add}
    assert headers["x-ratelimit-limit"] == "20"
    assert headers["x-ratelimit-remaining"] == "1"
    over = rls.client.ask("another", [("key2", key)], hits=2)
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining"] == "1"
    # the refusal's head less the framing of a body the RLS never sends (content-length was added)
    assert not {"content-length", "content-type"} & set(headers), headers


def test_admin_override_of_a_native_rule(rls: Rls) -> None:
    """A domain's rules are a route's (`rls.<domain>`): an identity's override applies to its calls,
    and GET /limits lists the domain's rules. The same call asked before the override, often enough
    to be remembered with what it counts (gateway/rls/service.py), follows it too."""
    user = unique()
    for _ in range(3):  # seen once, remembered, what it counts taken from memory
        assert remaining(rls.client.ask("native", Descriptor([("user", user)], hits=0))) == [3]
    url = f"{rls.gateway.admin_url}/overrides/rls.native/user_bucket"
    put = httpx.put(url, params={"key": user}, json={"rate": "1/min", "burst": 5}, timeout=5)
    assert put.status_code == 200, put.text
    # every worker follows within its sync period; a look (hits 0) counts nothing
    wait_until(lambda: remaining(rls.client.ask("native", Descriptor([("user", user)], hits=0))) == [5])
    answers = [rls.client.ask("native", [("user", user)]).overall_code for _ in range(6)]
    assert answers == [OK] * 5 + [OVER_LIMIT]
    assert remaining(rls.client.ask("native", Descriptor([("user", unique())], hits=0))) == [3]  # others: 3
    state = httpx.get(f"{rls.gateway.admin_url}/limits/rls.native/user_bucket", params={"key": user}, timeout=5)
    assert state.status_code == 200, state.text
    assert state.json()["remaining"] == 0
    limits = httpx.get(f"{rls.gateway.admin_url}/limits", timeout=5).json()
    native = next(r for r in limits["routes"] if r["name"] == "rls.native")
    assert native["match"] == {"rls_domain": "native"}
    assert {rule["name"] for rule in native["rules"]} == {"user_bucket", "org_window", "free_plan", "daily"}


def test_health(rls: Rls) -> None:
    assert rls.client.health() == pb.SERVING
    assert rls.client.health("envoy.service.ratelimit.v3.RateLimitService") == pb.SERVING
    status, _ = error_of(lambda: rls.client.health("nosuch"))
    assert status is grpc.StatusCode.NOT_FOUND


# --- under concurrency, and without Redis ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lean", "grpclib"])
def test_exact_under_concurrent_calls(tmp_path: Path, redis_proc: RedisProcess, kind: str) -> None:
    """Two workers, 8 client threads, 200 calls on (user 50/min, site 1000/min) and (site) alone:
    exactly 50 pass the user's limit, and the site counts exactly what passed."""
    server = start_rls(tmp_path, redis_proc.url, {"site.yaml": SITE.replace("3}", "50}").replace("5}", "1000}")},
                       CONFIG.split("rls:")[0] + "rls: {files: [site.yaml]}\n", kind, workers=2)
    site = unique()
    passed: list[int] = []
    lock = threading.Lock()

    def caller() -> None:
        client = RlsClient(server.port)
        try:
            for _ in range(25):
                code = client.ask("site", [("user", "u" + site)], [("site", site)]).overall_code
                with lock:
                    passed.append(code)
        finally:
            client.close()

    try:
        threads = [threading.Thread(target=caller) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert passed.count(OK) == 50
        assert remaining(server.client.ask("site", Descriptor([("site", site)], hits=0))) == [950]
    finally:
        server.client.close()
        server.gateway.stop()


def test_service_cache_error_is_unavailable(tmp_path: Path) -> None:
    """Redis gone: UNAVAILABLE within redis.timeout (Envoy's failure_mode_deny decides), health
    NOT_SERVING once the breaker opens; both back when Redis is."""
    redis = RedisProcess()
    redis.start()
    server = start_rls(tmp_path, redis.url, {"another.yaml": ANOTHER},
                       CONFIG.split("rls:")[0] + "rls: {files: [another.yaml]}\n")
    try:
        assert server.client.ask("another", [("key2", "k")]).overall_code == OK
        assert redis.process is not None
        redis.process.send_signal(signal.SIGSTOP)  # a Redis that answers nothing: no hang past redis.timeout
        try:
            status, details = error_of(lambda: server.client.ask("another", [("key2", "k")], timeout=3))
            assert status is grpc.StatusCode.UNAVAILABLE
        finally:
            redis.process.send_signal(signal.SIGCONT)
        wait_until(lambda: server.client.health() == pb.SERVING, timeout=15)
        redis.process.kill()  # gone: connections refused
        redis.process.wait()
        for _ in range(5):
            status, details = error_of(lambda: server.client.ask("another", [("key2", "k")], timeout=2))
            assert status is grpc.StatusCode.UNAVAILABLE
            assert "unavailable" in details
        assert server.client.health() == pb.NOT_SERVING
        redis.restart()  # the same port, empty
        wait_until(lambda: server.client.health() == pb.SERVING, timeout=15)
        assert server.client.ask("another", [("key2", "k")]).overall_code == OK
    finally:
        server.client.close()
        server.gateway.stop()
        redis.stop()


def test_rls_only_config_needs_no_route(tmp_path: Path, redis_proc: RedisProcess) -> None:
    """A team moving from envoyproxy/ratelimit mounts its files and nothing else."""
    server = start_rls(tmp_path, redis_proc.url, {"basic.yaml": BASIC},
                       "version: 1\nrls: {files: [basic.yaml]}\n")
    try:
        assert remaining(server.client.ask("basic", [("key1", unique())])) == [49]
    finally:
        server.client.close()
        server.gateway.stop()


# --- test/config/config_test.go: the errors, each naming file, line and key --------------------------

ERRORS = {
    "TestEmptyDomain": ("descriptors: []\n", 1, "domain", "config file cannot have empty domain"),
    "TestEmptyKey": ("domain: d\ndescriptors:\n  - value: v\n", 3, "descriptors[0].key", "descriptor has empty key"),
    "TestDuplicateKey": ("domain: d\ndescriptors:\n  - {key: key1, value: value1}\n  - {key: key1, value: value1}\n",
                         4, "descriptors[1]", "duplicate descriptor composite key 'key1_value1'"),
    "TestBadLimitUnit": ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: foo, requests_per_unit: 1}\n",
                         4, "descriptors[0].rate_limit.unit", "invalid rate limit unit 'foo'"),
    "TestReplacesSelf": ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n"
                         "      requests_per_unit: 1\n      name: me\n      replaces: [{name: me}]\n",
                         8, "descriptors[0].rate_limit.replaces[0]", "replaces should not contain name of same"),
    "TestReplacesEmpty": ("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n"
                          "      requests_per_unit: 1\n      replaces: [{name: ''}]\n",
                          7, "descriptors[0].rate_limit.replaces[0]", "should not have an empty replaces entry"),
    "TestBadYaml": ("domain: d\ndescriptors: [\n", 3, "(document)", "error loading config file"),
    "TestMisspelledKey": ("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second}\n",
                          4, "descriptors[0].ratelimit", "unknown key 'ratelimit'"),
    "TestMisspelledKey2": ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requestsperunit: 5}\n",
                           4, "descriptors[0].rate_limit.requestsperunit", "unknown key 'requestsperunit'"),
    "TestNonMapList": ("domain: d\ndescriptors:\n  - a\n", 3, "descriptors[0]", "must be a mapping"),
    "TestUnlimitedWithRateLimitUnit": ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, "
                                       "unit: day}\n", 4, "descriptors[0].rate_limit.unit",
                                       "should not specify rate limit unit when unlimited"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_config_errors_name_file_line_and_key(tmp_path: Path, case: str) -> None:
    text, line, key, message = ERRORS[case]
    (tmp_path / "rl.yaml").write_text(text)
    (tmp_path / "routes.yaml").write_text("version: 1\nrls: {files: [rl.yaml]}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml")
    problems = raised.value.problems
    assert any(p.file.endswith("rl.yaml") and p.line == line and p.key == key and message in p.message
               for p in problems), [str(p) for p in problems]


def test_config_duplicate_domain_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(BASIC)
    (tmp_path / "b.yaml").write_text(BASIC)
    (tmp_path / "routes.yaml").write_text("version: 1\nrls: {files: [a.yaml, b.yaml]}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml")
    assert "duplicate domain 'basic'" in str(raised.value.problems[0])
    assert raised.value.problems[0].line == 2


def test_native_form_errors(tmp_path: Path) -> None:
    (tmp_path / "routes.yaml").write_text(textwrap.dedent("""\
        version: 1
        rls:
          domains:
            edge:
              descriptors:
                - key: user
                  limit: {name: a, by: [ip], algorithm: fixed_window, limit: 1, window: 1s}
                - key: ip
                  limit: {name: b, algorithm: concurrency, limit: 1}
                - value: x
                - key: path
                  limit: {name: c, algorithm: leaky_bucket, rate: 1/s, burst: 2}
            "bad domain": {descriptors: []}
        """))
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml")
    shown = [str(p) for p in raised.value.problems]
    assert any(":7: rls.domains.edge.descriptors[0].limit.by:" in s and "leave out `by`" in s for s in shown), shown
    assert any(":9: rls.domains.edge.descriptors[1].limit.algorithm:" in s for s in shown), shown
    assert any(":10: rls.domains.edge.descriptors[2].key: is required" in s for s in shown), shown
    assert any(":12: rls.domains.edge.descriptors[3].limit.algorithm: leaky_bucket admits a request after a delay"
               in s for s in shown), shown
    assert any(":13: rls.domains.bad domain:" in s for s in shown), shown


def test_the_schema_takes_both_forms() -> None:
    """gateway/routes.schema.json (for editors) agrees with the loader on `rls:`."""
    from tests.test_schema import schema_errors

    def errors(text: str) -> list[str]:
        return schema_errors(yaml.safe_load(text))

    assert errors(CONFIG) == []
    assert errors("version: 1\nrls: {files: [a.yaml]}\n") == []           # no route needed
    assert errors("version: 1\n") != []                                    # ... without rls
    assert errors(CONFIG.replace("{name: user_bucket,", "{name: user_bucket, by: [ip],")) != []


def test_a_descriptor_limit_in_a_domain_without_rules(tmp_path: Path, redis_proc: RedisProcess) -> None:
    """A domain whose file has only unlimited entries still takes a descriptor's own limit."""
    server = start_rls(tmp_path, redis_proc.url,
                       {"free.yaml": "domain: free\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true}\n"},
                       "version: 1\nrls: {files: [free.yaml]}\n")
    try:
        key = unique()
        answers = [server.client.ask("free", Descriptor([("k", key)], limit=(1, MINUTE))) for _ in range(2)]
        assert [r.overall_code for r in answers] == [OK, OVER_LIMIT]
        assert remaining(server.client.ask("free", [("k", key)])) == [2**32 - 1]
    finally:
        server.client.close()
        server.gateway.stop()


def test_tls_with_alpn_h2(tmp_path: Path, redis_proc: RedisProcess) -> None:
    """--rls-tls-cert/--rls-tls-key: the same service over TLS, HTTP/2 by ALPN; a cleartext client
    gets nothing."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    (tmp_path / "basic.yaml").write_text(BASIC)
    port = free_port()
    gateway = GatewayProcess("version: 1\nrls: {files: [basic.yaml]}\n", tmp_path, redis_url=redis_proc.url,
                             args=("--rls-port", str(port), "--rls-tls-cert", str(tmp_path / "server.pem"),
                                   "--rls-tls-key", str(tmp_path / "server.pem")))
    gateway.start()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    channel = grpc.secure_channel(f"127.0.0.1:{port}", credentials)
    try:
        call = channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        answer = pb.RateLimitResponse.FromString(call(request("basic", [("key1", unique())]).SerializeToString(),
                                                      timeout=5))
        assert remaining(answer) == [49]
        plain = RlsClient(port)
        status, _ = error_of(lambda: plain.ask("basic", [("key1", "x")], timeout=3))
        assert status is grpc.StatusCode.UNAVAILABLE
        plain.close()
    finally:
        channel.close()
        gateway.stop()


def test_tls_files_that_cannot_be_used_stop_the_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "routes.yaml").write_text("version: 1\nrls: {domains: {}}\n")
    (tmp_path / "bad.pem").write_text("not a certificate")
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "routes.yaml"),
                           "--rls-port", str(free_port()), "--rls-tls-cert", str(tmp_path / "bad.pem"),
                           "--rls-tls-key", str(tmp_path / "bad.pem")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "certificate or key cannot be used" in done.stderr
    half = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "routes.yaml"),
                           "--rls-port", str(free_port()), "--rls-tls-cert", str(tmp_path / "bad.pem")],
                          capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "go together" in half.stderr


def test_an_edited_rls_file_is_reloaded(tmp_path: Path, redis_proc: RedisProcess) -> None:
    """A file of rls.files is watched as routes.yaml is: saved, it is in force within the watch
    period; saved broken, the last good one stays."""
    server = start_rls(tmp_path, redis_proc.url, {"basic.yaml": BASIC}, "version: 1\nrls: {files: [basic.yaml]}\n")
    try:
        def limit() -> tuple[int, int] | None:
            return limit_of(server.client.ask("basic", Descriptor([("key1", "x")], hits=0)).statuses[0])

        assert limit() == (50, SECOND)
        (tmp_path / "basic.yaml").write_text(BASIC.replace("requests_per_unit: 50", "requests_per_unit: 70"))
        wait_until(lambda: limit() == (70, SECOND), timeout=15)
        (tmp_path / "basic.yaml").write_text("domain: basic\ndescriptors:\n  - value: no key\n")
        wait_until(lambda: "descriptor has empty key" in server.gateway.log(), timeout=15)
        assert limit() == (70, SECOND)
    finally:
        server.client.close()
        server.gateway.stop()


def test_a_sharded_domain_needs_a_share_for_every_rule(tmp_path: Path) -> None:
    (tmp_path / "routes.yaml").write_text(
        "version: 1\nrls:\n  domains:\n    d:\n      shards: 4\n      descriptors:\n"
        "        - {key: user, limit: {name: user, algorithm: fixed_window, limit: 3, window: 1m}}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml")
    (problem,) = raised.value.problems
    assert (problem.line, problem.key) == (5, "rls.domains.d.shards")
    assert "rule 'user' (limit 3) cannot be split over 4 shards" in problem.message


# --- a bounded number of scripts whatever the calls' shapes ------------------------------------------

PAIR_CONFIG = """\
version: 1
rls:
  domains:
    pair:
      descriptors:
        - key: user
          limit: {name: per_user, algorithm: fixed_window, limit: 3, window: 1h}
        - key: site
          limit: {name: per_site, algorithm: fixed_window, limit: 5, window: 1h}
"""


def test_a_call_of_every_rule_in_the_files_order_runs_the_routes_own_script(tmp_path: Path) -> None:
    """Envoy's usual call, a descriptor per rule of the domain in the file's order, runs the script
    the domain's route already has (10-18% cheaper in Redis than the one for any kinds); the same
    rules in another order run the one for any kinds. Both decide all or nothing alike."""
    server = RedisProcess()
    server.start()
    rls = start_rls(tmp_path, server.url, {}, PAIR_CONFIG)
    info = server.client()
    any_kinds = generic_script(()).script.sha.decode()
    try:
        for first, second, order in ((("user", "A"), ("site", "S"), "file"), (("site", "T"), ("user", "C"), "other")):
            answers = [rls.client.ask("pair", [first], [second]).overall_code for _ in range(5)]
            assert answers == [OK, OK, OK, OVER_LIMIT, OVER_LIMIT], order  # the user's 3; the refused count nothing
            other_user = ("user", "B") if order == "file" else ("user", "D")
            pair = [[other_user], [("site", "S")]] if order == "file" else [[("site", "T")], [other_user]]
            assert [rls.client.ask("pair", *pair).overall_code for _ in range(3)] == [OK, OK, OVER_LIMIT], order
            assert info.script_exists(any_kinds) == [order == "other"], order
        assert decision_scripts(info) == 2  # the route's, then the one for any kinds
    finally:
        rls.client.close()
        assert rls.gateway.stop() == 0
        server.stop()


KIND_RULES = {
    "fw": "algorithm: fixed_window, limit: 1000, window: 1h",
    "tb": "algorithm: token_bucket, rate: 1000/h, burst: 1000",
    "gc": "algorithm: gcra, rate: 1000/h, burst: 1000",
    "sw": "algorithm: sliding_window, limit: 1000, window: 1h",
    "sl": "algorithm: sliding_log, limit: 1000, window: 1h",
    "qp": "algorithm: quota, limit: 1000, period: 1d",
    "qn": "algorithm: quota, limit: 1000",
    "cal": "algorithm: fixed_window, limit: 1000, window: day, calendar: Europe/Berlin",
}
KINDS = [*KIND_RULES, *(f"s_{kind}" for kind in KIND_RULES)]
KINDS_CONFIG = "version: 1\nrls:\n  domains:\n    kinds:\n      descriptors:\n" + "".join(
    f"        - key: {prefix}{kind}\n          limit: {{name: {prefix}{kind}, {rule}{shadow}}}\n"
    for prefix, shadow in (("", ""), ("s_", ", shadow: true")) for kind, rule in KIND_RULES.items()
) + "        - key: one\n          limit: {name: one, algorithm: quota, limit: 1}\n"


def _shapes(count: int) -> list[list[int]]:
    """`count` distinct combinations of limit kinds: how many descriptors of each kind, 31 at most."""
    rng = random.Random(40)
    seen: set[tuple[int, ...]] = {tuple([31] + [0] * (len(KINDS) - 1))}
    shapes = [list(next(iter(seen)))]
    while len(shapes) < count:
        shape = tuple(rng.choice((0, 0, 1, 2)) for _ in KINDS)
        if 0 < sum(shape) <= 31 and shape not in seen:
            seen.add(shape)
            shapes.append(list(shape))
    return shapes


def test_calls_of_many_shapes_load_a_bounded_number_of_scripts(tmp_path: Path) -> None:
    """320 calls, each a new combination of limit kinds: each loaded a script of its own (16 MB of
    Redis, kept for good) and, past 256 of them, every new one was refused RESOURCE_EXHAUSTED, the
    legitimate calls of other clients too. Now every call is answered, all or nothing as ever, and
    the scripts Redis holds do not grow with the shapes."""
    server = RedisProcess()
    server.start()
    rls = start_rls(tmp_path, server.url, {}, KINDS_CONFIG)
    info = server.client()
    try:
        rls.client.ask("kinds", [("one", "warm")], [("fw", "warm")])
        scripts_before = decision_scripts(info)
        for n, shape in enumerate(_shapes(320)):
            descriptors = [[("one", f"one-{n}")]] + [
                [(kind, f"{n}-{kind}-{c}")] for kind, copies in zip(KINDS, shape, strict=True) for c in range(copies)]
            first = rls.client.ask("kinds", *descriptors)
            assert first.overall_code == OK, (n, shape)
            assert remaining(first) == [0] + [999] * (len(descriptors) - 1), (n, shape)
            again = rls.client.ask("kinds", *descriptors)  # `one` is spent: refused, and nothing else counted
            assert again.overall_code == OVER_LIMIT, (n, shape)
            assert codes(again) == [OVER_LIMIT] + [OK] * (len(descriptors) - 1), (n, shape)
            assert remaining(again)[1:] == [999] * (len(descriptors) - 1), (n, shape)
        for n in range(20):  # one descriptor with a limit of its own: the client's number chooses no script
            assert rls.client.ask("kinds", Descriptor([("fw", f"own-{n}")], limit=(n + 1, MINUTE))).overall_code == OK
        assert decision_scripts(info) == scripts_before == 1  # the script for any kinds
    finally:
        rls.client.close()
        assert rls.gateway.stop() == 0
        server.stop()
