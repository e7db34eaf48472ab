"""A refusal's rate-limit fields are honest for every rule: a refused request charged nothing, so a
rule it did not exhaust reports what it has left now, whether Redis refused or the worker's memory
answered the refusal again (docs/algorithms.md, "The same answer")."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: orders
    match: {{path: /echo/orders}}
    upstream: up
    limits:
      - {{name: stock, by: [], algorithm: quota, limit: 100}}
      - {{name: duplicate, by: ["header:X-Order-Id"], algorithm: fixed_window, limit: 1, window: 1h, status: 409}}
"""


def _items(answer: httpx.Response) -> dict[str, str]:
    return {item.split(";")[0].strip().strip('"'): item.strip() for item in answer.headers["ratelimit"].split(",")}


def test_a_refusal_tells_every_rule_what_it_has_left_from_redis_and_from_memory(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    gateway = GatewayProcess(CONFIG.format(prefix=f"h{uuid.uuid4().hex[:8]}", upstream=upstream.url), tmp_path,
                             redis_url=redis_proc.url)
    gateway.start()
    try:
        with httpx.Client(base_url=gateway.url) as client:
            first = client.get("/echo/orders", headers={"X-Order-Id": "o-1"})
            assert first.status_code == 200 and _items(first)["stock"] == '"stock";r=99'
            again = [client.get("/echo/orders", headers={"X-Order-Id": "o-1"}) for _ in range(5)]
            assert {answer.status_code for answer in again} == {409}
            # 99 left of the stock: the refused duplicates took none of it, Redis's answer or memory's
            assert [_items(answer)["stock"] for answer in again] == ['"stock";r=99'] * 5
            assert all(_items(answer)["duplicate"].startswith('"duplicate";r=0;t=') for answer in again)
            second = client.get("/echo/orders", headers={"X-Order-Id": "o-2"})
            assert second.status_code == 200 and _items(second)["stock"] == '"stock";r=98'
        metrics = httpx.get(gateway.admin_url + "/metrics").text
        assert 'decided_by="memory",outcome="refused",route="orders",rule="duplicate"' in metrics
    finally:
        assert gateway.stop() == 0
