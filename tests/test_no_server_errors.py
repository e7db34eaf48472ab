"""No request, however malformed, gets a 500 (issue 33's class): every parser the gateway runs on
what a client, an upstream or an operator sends, fed hostile values by hypothesis, answers a 4xx
(or passes the request on) and logs no traceback.

    a route's `match:`   a tier header or the bearer token sent twice (was a 500: the router read them)
    response cost        an upstream's X-Tokens of '²' or other non-ASCII digits (was a 500)
    admin queries        ?limit= and ?cursor= of '²' (was a 500), /top?route= of no route (was a 200)
    admin bodies         an override's JSON nested 4,000 deep (was a 500: RecursionError)
    JWT claims           an `exp` that is a numeric string (was cached as valid for ever)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt as pyjwt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

SECRET = "test-secret-of-at-least-32-bytes-long!"
TOKEN = "admin-token-for-the-no-500-tests"
CONFIG = f"""
version: 1
redis: {{{{timeout: 200ms}}}}
admin: {{{{token: {TOKEN}}}}}
jwt: {{{{secret: {SECRET}, algorithms: [HS256]}}}}
upstreams: {{{{up: {{{{url: "{{upstream}}"}}}}}}}}
routes:
  - name: pro
    match: {{{{path: "/api/{{{{rest:path}}}}", headers: {{{{X-Tier: [pro]}}}}}}}}
    upstream: up
  - name: staff
    match: {{{{path: "/api/{{{{rest:path}}}}", jwt: {{{{role: staff}}}}}}}}
    upstream: up
    limits: [{{{{name: sub, by: ["jwt:sub"], algorithm: quota, limit: 2, period: 1h}}}}]
  - name: api
    match: {{{{path: "/api/{{{{rest:path}}}}"}}}}
    upstream: up
    limits: [{{{{name: user, by: [header:X-User], algorithm: quota, limit: 1000, on_missing: ip}}}}]
  - name: tokens
    match: {{{{path: /tokens}}}}
    upstream: up
    limits: [{{{{name: t, by: [], algorithm: token_bucket, rate: 1000/s, burst: 100000,
               cost: "response_header:X-Tokens"}}}}]
"""
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE_NUMBERS = st.one_of(
    st.sampled_from(["²", "¹⁰", "١٢", "৩", "0x10", "-1", "1e3", " 7", "7 ", "", "99999999999999999999", "½"]),
    st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1, max_size=6),
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path_factory.mktemp("no500"),
                          redis_url=redis_proc.url)
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def _clean(response: httpx.Response, *allowed: int) -> None:
    assert response.status_code != 500, response.text
    assert response.status_code in allowed, (response.status_code, response.text)
    if response.status_code >= 400 and response.headers.get("x-upstream") != "echo":
        assert response.headers["content-type"] == "application/problem+json"


def test_a_match_header_or_token_sent_twice_is_a_400(gateway: GatewayProcess) -> None:
    tier = httpx.get(gateway.url + "/api/x", headers=[("X-Tier", "pro"), ("X-Tier", "free")])
    _clean(tier, 400)
    assert "X-Tier" in tier.json()["detail"] or "x-tier" in tier.json()["detail"]
    staff = pyjwt.encode({"sub": "s", "role": "staff"}, SECRET, algorithm="HS256")
    twice = httpx.get(gateway.url + "/api/x", headers=[("Authorization", f"Bearer {staff}"),
                                                        ("Authorization", "Bearer other")])
    _clean(twice, 400)
    assert httpx.get(gateway.url + "/api/x", headers={"Authorization": f"Bearer {staff}"}).status_code == 200

    def logged() -> bool:
        return any('"status": 400' in line and '"decision": "bad_request"' in line
                   for line in gateway.out_path.read_text().splitlines()) or "gateway_requests_total" in \
            httpx.get(gateway.admin_url + "/metrics").text

    assert logged()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=HOSTILE_NUMBERS)
def test_an_upstream_cost_header_that_is_no_whole_number_charges_nothing_and_answers(
        gateway: GatewayProcess, value: str) -> None:
    response = httpx.get(gateway.url + "/tokens", params={"n": value})
    _clean(response, 200)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=HOSTILE_NUMBERS, cursor=HOSTILE_NUMBERS)
def test_admin_paging_queries_are_a_400_never_a_500(gateway: GatewayProcess, limit: str, cursor: str) -> None:
    for path in ("/overrides", "/overrides/api/user"):
        response = httpx.get(gateway.admin_url + path, params={"limit": limit, "cursor": cursor}, headers=ADMIN)
        _clean(response, 200, 400)
    top = httpx.get(gateway.admin_url + "/top", params={"limit": limit, "window": cursor})
    _clean(top, 200, 400)


def test_top_of_no_such_route_is_a_404(gateway: GatewayProcess) -> None:
    _clean(httpx.get(gateway.admin_url + "/top", params={"route": "nosuch"}), 404)
    _clean(httpx.get(gateway.admin_url + "/top", params={"route": "api"}), 200)


@pytest.mark.parametrize("depth", [100, 1_500, 2_000, 4_000])  # 1,000 deep: RecursionError
def test_an_override_body_nested_deep_is_a_400(gateway: GatewayProcess, depth: int) -> None:
    body = "[" * depth + "]" * depth
    response = httpx.put(gateway.admin_url + "/overrides/api/user", params={"key": "alice"}, content=body,
                         headers=ADMIN)
    _clean(response, 400, 413)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3),
                         max_leaves=20))
def test_any_json_override_body_is_answered_without_a_500(gateway: GatewayProcess, body: object) -> None:
    response = httpx.put(gateway.admin_url + "/overrides/api/user", params={"key": "fuzzed"},
                         content=json.dumps(body), headers=ADMIN)
    _clean(response, 200, 400)


@pytest.mark.parametrize("exp", ["9999999999", "soon", True, [1]])
def test_a_token_whose_exp_is_not_a_number_is_no_identity(gateway: GatewayProcess, exp: object) -> None:
    """RFC 7519 4.1.4: exp is a NumericDate. A string that PyJWT reads as one was cached as valid
    for ever; now such a token verifies as nothing, so the staff route does not take it."""
    token = pyjwt.encode({"sub": f"exp-{exp!s}", "role": "staff", "exp": exp}, SECRET, algorithm="HS256")
    response = httpx.get(gateway.url + "/api/x", headers={"Authorization": f"Bearer {token}"})
    _clean(response, 200)
    statuses = [httpx.get(gateway.url + "/api/x", headers={"Authorization": f"Bearer {token}"}).status_code
                for _ in range(3)]
    assert statuses == [200, 200, 200]  # the api route (1000), not staff's quota of 2
    good = pyjwt.encode({"sub": f"good-{exp!s}", "role": "staff", "exp": int(time.time()) + 60}, SECRET,
                        algorithm="HS256")
    assert [httpx.get(gateway.url + "/api/x", headers={"Authorization": f"Bearer {good}"}).status_code
            for _ in range(3)] == [200, 200, 429]


def test_nothing_above_logged_a_traceback(gateway: GatewayProcess) -> None:
    assert "Traceback" not in gateway.log()
    assert isinstance(Path(gateway.out_path), Path)
