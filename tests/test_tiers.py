"""Tiers and allowlists are routes (issue 20, SPEC §2 "Matching on who is asking"): pro and free
keys by a header and by a verified JWT claim, an exempt network behind a trusted proxy, against a
real gateway, Redis and upstream."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

SECRET = "tier-secret-" + "x" * 32
CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
trusted_proxies: [127.0.0.1/32]
jwt: {{algorithms: [HS256], secret: "{secret}"}}
upstreams:
  up: {{url: "{upstream}"}}
routes:
  - name: internal                 # an exempt network: no limits
    match: {{path: "/echo/{{rest:path}}", client: [10.20.0.0/16]}}
    upstream: up
  - name: pro-key
    match: {{path: "/echo/{{rest:path}}", headers: {{X-Plan: [pro, enterprise]}}}}
    upstream: up
    limits: [{{name: user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 5, window: 1h}}]
  - name: pro-token
    match: {{path: "/echo/{{rest:path}}", jwt: {{plan: pro}}}}
    upstream: up
    limits: [{{name: sub, by: ["jwt:sub"], algorithm: fixed_window, limit: 4, window: 1h}}]
  - name: free
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits: [{{name: ip, by: [ip], algorithm: fixed_window, limit: 2, window: 1h}}]
"""


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    text = CONFIG.format(prefix=f"t{uuid.uuid4().hex[:8]}", secret=SECRET, upstream=upstream.url)
    proc = GatewayProcess(text, tmp_path, redis_url=redis_proc.url)
    proc.start()
    yield proc
    assert proc.stop() == 0


def statuses(gateway: GatewayProcess, count: int, headers: dict[str, str]) -> list[tuple[int, str]]:
    """Statuses and the route that answered a refusal ("" for an admitted request)."""
    out = []
    with httpx.Client(base_url=gateway.url) as client:
        for _ in range(count):
            response = client.get("/echo/x", headers=headers)
            out.append((response.status_code, response.json().get("route", "") if response.status_code >= 400 else ""))
    return out


def test_pro_and_free_keys_by_header(gateway: GatewayProcess) -> None:
    pro = statuses(gateway, 6, {"X-Plan": "pro", "X-User-Id": "alice"})
    assert pro == [(200, "")] * 5 + [(429, "pro-key")]
    assert statuses(gateway, 1, {"X-Plan": "enterprise", "X-User-Id": "bob"}) == [(200, "")]
    # another value, or none: the tier's route is passed over, the free one takes it
    assert statuses(gateway, 3, {"X-Plan": "gold", "X-User-Id": "carol"}) == [(200, ""), (200, ""), (429, "free")]


def test_pro_and_free_by_a_verified_jwt_claim(gateway: GatewayProcess) -> None:
    token = jwt.encode({"sub": "dave", "plan": "pro"}, SECRET, algorithm="HS256")
    pro = statuses(gateway, 5, {"Authorization": f"Bearer {token}"})
    assert pro == [(200, "")] * 4 + [(429, "pro-token")]
    forged = jwt.encode({"sub": "erin", "plan": "pro"}, "not-the-secret" + "y" * 32, algorithm="HS256")
    assert statuses(gateway, 3, {"Authorization": f"Bearer {forged}"})[-1] == (429, "free")  # unverified: free


def test_an_exempt_network_behind_a_trusted_proxy(gateway: GatewayProcess) -> None:
    inside = statuses(gateway, 10, {"X-Forwarded-For": "10.20.3.4"})
    assert inside == [(200, "")] * 10
    outside = statuses(gateway, 3, {"X-Forwarded-For": "192.0.2.7"})
    assert outside == [(200, ""), (200, ""), (429, "free")]
