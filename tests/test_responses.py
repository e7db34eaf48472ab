"""gateway/responses.py: the rate-limit headers describe every rule a request was counted by, and
Kong's per-window legacy headers; end to end, with a real Redis deciding."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import httpx
import pytest

from gateway.config import Rule, parse_config
from gateway.limiter import Decision, RuleOutcome, RuleState
from gateway.responses import ratelimit_headers
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

RULES = """
version: 1
upstreams: {up: {url: "http://127.0.0.1:1"}}
routes:
  - name: r
    match: {path: /r}
    upstream: up
    limits:
      - {name: per-second, by: [ip], algorithm: sliding_window, limit: 10, window: 1s}
      - {name: per-minute, by: [ip], algorithm: fixed_window, limit: 100, window: 1m}
      - {name: per-day, by: [ip], algorithm: quota, limit: 5000, period: 1d}
      - {name: bucket, by: [ip], algorithm: token_bucket, rate: 1/s, burst: 60}
      - {name: watching, by: [ip], algorithm: fixed_window, limit: 1, window: 1h, shadow: true}
"""


def _rules() -> tuple[Rule, ...]:
    return parse_config(textwrap.dedent(RULES), "routes.yaml", {}).routes[0].limits


def _admitted(*remaining: int) -> Decision:
    return Decision(True, None, None, 0, tuple(RuleState(RuleOutcome.ADMITS, r, 30_500) for r in remaining))


def test_draft_fields_list_every_enforced_rule_the_most_restrictive_first() -> None:
    headers = dict(ratelimit_headers("draft", _rules(), _admitted(9, 3, 4000, 50, 0)))
    assert headers[b"ratelimit-policy"] == (b'"per-minute";q=100;w=60, "per-second";q=10;w=1, '
                                            b'"per-day";q=5000;w=86400, "bucket";q=60;w=60')
    assert headers[b"ratelimit"] == (b'"per-minute";r=3;t=31, "per-second";r=9;t=31, '
                                     b'"per-day";r=4000;t=31, "bucket";r=50;t=31')
    assert b"watching" not in headers[b"ratelimit-policy"]  # a shadow rule enforces nothing


def test_a_refusal_names_the_refusing_rule_first() -> None:
    refused = Decision(False, 2, 1000, 0, tuple(RuleState(o, r, 1000) for o, r in (
        (RuleOutcome.ADMITS, 1), (RuleOutcome.ADMITS, 0), (RuleOutcome.REFUSES, 0), (RuleOutcome.ADMITS, 9),
        (RuleOutcome.ADMITS, 0))))
    headers = dict(ratelimit_headers("both", _rules(), refused))
    assert headers[b"ratelimit"].startswith(b'"per-day";r=0;t=1, "per-second";r=1;t=1')
    assert headers[b"x-ratelimit-limit"] == b"5000" and headers[b"x-ratelimit-remaining"] == b"0"


def test_legacy_adds_kongs_per_window_fields_for_whole_units() -> None:
    headers = ratelimit_headers("legacy", _rules(), _admitted(9, 3, 4000, 50, 0))
    named = dict(headers)
    assert (named[b"x-ratelimit-limit"], named[b"x-ratelimit-remaining"], named[b"x-ratelimit-reset"]) == \
        (b"100", b"3", b"31")  # the most restrictive, as before
    assert named[b"x-ratelimit-limit-second"] == b"10" and named[b"x-ratelimit-remaining-second"] == b"9"
    assert named[b"x-ratelimit-limit-minute"] == b"100" and named[b"x-ratelimit-remaining-minute"] == b"3"
    assert named[b"x-ratelimit-limit-day"] == b"5000" and named[b"x-ratelimit-remaining-day"] == b"4000"
    assert not any(name.startswith(b"ratelimit") for name, _ in headers)
    assert len(headers) == 3 + 6  # the token bucket has no window of its own; the shadow rule is left out


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> GatewayProcess:
    text = textwrap.dedent(RULES).replace("http://127.0.0.1:1", upstream.url).replace("path: /r", "path: /echo/r")
    text = text.replace("version: 1\n", f"version: 1\nredis: {{key_prefix: h{uuid.uuid4().hex[:8]}}}\n"
                                        "defaults: {headers: both}\n")
    return GatewayProcess(text, tmp_path, redis_url=redis_proc.url)


def test_an_admitted_request_through_the_proxy_carries_every_rule(gateway: GatewayProcess) -> None:
    gateway.start()
    try:
        with httpx.Client(base_url=gateway.url) as client:
            answers = [client.get("/echo/r") for _ in range(3)]
        last = answers[-1]
        assert last.status_code == 200
        items = [item.split(";")[0] for item in last.headers["ratelimit"].split(", ")]
        assert sorted(items) == ['"bucket"', '"per-day"', '"per-minute"', '"per-second"']
        assert items[0] == '"per-second"'  # 7 of 10 left: the least
        assert '"per-day";r=4997' in last.headers["ratelimit"]
        assert last.headers["x-ratelimit-remaining-minute"] == "97"
        assert last.headers["x-ratelimit-remaining-second"] == "7"
        assert last.headers["x-ratelimit-remaining-day"] == "4997"
    finally:
        assert gateway.stop() == 0
