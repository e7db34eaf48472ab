"""Who is being limited (issue 20): the identities refused most, in bounded memory, all workers
together (`GET /top`), and the access log naming the rule and the identity token that
`GET /limits/{route}/{rule}?key=` takes."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.top import SpaceSaving, TopRefused
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=400), st.integers(2, 16))
def test_space_saving_keeps_every_heavy_hitter_with_bounded_error(stream: list[int], capacity: int) -> None:
    sketch = SpaceSaving(capacity)
    for value in stream:
        sketch.add(("r", "u", str(value), ""))
    assert len(sketch.counts) <= capacity  # memory bounded, whatever the number of identities
    truth = Counter(str(v) for v in stream)
    kept = {item[2]: (count, error) for item, count, error in sketch.items()}
    for identity, true_count in truth.items():
        if true_count > len(stream) / capacity:  # a heavy hitter is never lost
            assert identity in kept
    for identity, (count, error) in kept.items():
        assert count - error <= truth[identity] <= count  # never under, over by at most its error


def test_minutes_outside_the_window_are_not_counted_and_old_ones_are_dropped(tmp_path: Path) -> None:
    top = TopRefused(capacity=8, directory=str(tmp_path))
    top.record("api", "ip", "1.2.3.4", now=1_000_000.0)
    top.record("api", "ip", "5.6.7.8", now=1_000_000.0 + 600)
    top.record("api", "ip", "5.6.7.8", now=1_000_000.0 + 601)
    assert [(r.identity, r.refusals) for r in top.top(300, now=1_000_000.0 + 620)] == [("5.6.7.8", 2)]
    assert len(top.top(3600, now=1_000_000.0 + 620)) == 2
    top.record("api", "ip", "9.9.9.9", now=1_000_000.0 + 2 * 3600)
    assert len(top.minutes) == 1  # an hour on, the old minutes are gone


CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
access_log: true
upstreams:
  up: {{url: "{upstream}"}}
routes:
  - name: api
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 2, window: 1h}}
  - name: pair
    match: {{path: "/pair/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: both, by: ["header:X-User-Id", ip], algorithm: fixed_window, limit: 1, window: 1h}}
"""


def test_the_top_refused_after_a_flood_all_workers_together(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    text = CONFIG.format(prefix=f"t{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    gateway = GatewayProcess(text, tmp_path, redis_url=redis_proc.url, workers=2)
    gateway.start()
    stack = ExitStack()
    try:
        abuser = "mallory/" + uuid.uuid4().hex  # a user id: shown as it came, though its key is a digest

        def get(user: str) -> int:
            with httpx.Client(base_url=gateway.url) as client:  # new connections: both workers serve
                return client.get("/echo/x", headers={"X-User-Id": user}).status_code

        users = [abuser] * 120 + [f"user{i}" for i in range(20) for _ in range(4)]
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(get, users))
        assert statuses.count(429) == 118 + 20 * 2
        admin = stack.enter_context(httpx.Client(base_url=gateway.admin_url))

        def top() -> list[dict[str, object]]:
            found: list[dict[str, object]] = admin.get("/top", params={"route": "api", "window": "5m"}).json()["top"]
            return found

        def settled() -> bool:  # every worker's refusals have reached the shared directory
            found = top()
            return [entry["refusals"] for entry in found] == [118] + [2] * 19  # the 20 default
        wait_until(settled, timeout=10)
        first = top()[0]
        assert (first["route"], first["rule"], first["identity"]) == ("api", "user", abuser)
        # the identity it names is the key the admin API looks up
        state = admin.get("/limits/api/user", params={"key": str(first["identity"])}).json()
        assert state["exhausted"] is True and state["remaining"] == 0
        assert admin.get("/limits/api/user", params={"key": abuser}).json()["key"] == state["key"]
        assert admin.get("/top", params={"window": "2h"}).status_code == 400

        # the values of a two-part identity (user, address) work as key= too
        assert get_pair(gateway, "carol") == [200, 429]
        assert admin.get("/limits/pair/both", params={"key": "carol:127.0.0.1"}).json()["exhausted"] is True
        wait_until(lambda: "carol:127.0.0.1" in json.dumps(admin.get("/top", params={"route": "pair"}).json()),
                   timeout=5)
    finally:
        stack.close()
        assert gateway.stop() == 0
    # the access log names the rule and the identity of every refusal, as /top and the admin port do:
    # a user id as it came (a secret would be its fingerprint: tests/test_fingerprints.py)
    log = gateway.out_path.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    refused = [line for line in lines if line["route"] == "pair" and line["status"] == 429]
    assert [(line["rule"], line["decision"], line["identity"]) for line in refused] == \
        [("both", "refused", "carol:127.0.0.1")]
    flood = [line for line in lines if line["identity"] == first["identity"]]
    assert len(flood) == 118 and {line["decided_by"] for line in flood} <= {"redis", "memory"}


def get_pair(gateway: GatewayProcess, user: str) -> list[int]:
    with httpx.Client(base_url=gateway.url) as client:
        return [client.get("/pair/x", headers={"X-User-Id": user}).status_code for _ in range(2)]
