"""Per-identity overrides on Redis Cluster, on a sharded route: the store lives in the route's hash
tag, and a split rule's override is split over the shards, never admitting more than it says."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path

import httpx

from tests.support.cluster import RedisCluster
from tests.support.gateway_proc import GatewayProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until


def test_a_split_rule_s_override_holds_over_the_shards_of_a_cluster(cluster: RedisCluster, upstream: Upstream,
                                                                   tmp_path: Path) -> None:
    config = f"""
    version: 1
    redis: {{url: "{cluster.url}", mode: cluster, timeout: 500ms, key_prefix: o{uuid.uuid4().hex[:6]}}}
    upstreams: {{up: {{url: "{upstream.url}"}}}}
    routes:
      - name: sale
        match: {{path: "/echo/sale/{{item}}"}}
        upstream: up
        shards: 2
        limits:
          - {{name: user, by: [header:X-User], algorithm: gcra, rate: 100/s, burst: 100}}
          - {{name: stock, by: [path:item], algorithm: quota, limit: 4}}
    """
    gateway = GatewayProcess(config, tmp_path, workers=2)
    gateway.start()
    users = (f"u{n}" for n in itertools.count())
    try:
        def burst(size: int) -> int:
            async def run() -> int:
                async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
                    calls = [client.get("/echo/sale/9", headers={"X-User": next(users)}) for _ in range(size)]
                    return sum(r.status_code == 200 for r in await asyncio.gather(*calls))
            return asyncio.run(run())

        sold = burst(40)
        assert sold == 4                                                # 2 in each shard
        answer = httpx.put(f"{gateway.admin_url}/overrides/sale/stock", params={"key": "9"}, json={"limit": 10})
        assert answer.status_code == 200, answer.text

        def more() -> bool:
            nonlocal sold
            sold += burst(20)
            return sold >= 10

        wait_until(more, timeout=5)                                     # both workers, within 2 s
        assert sold == 10 and burst(40) == 0                            # 5 in each shard, never more
        too_small = httpx.put(f"{gateway.admin_url}/overrides/sale/stock", params={"key": "8"}, json={"limit": 1})
        assert too_small.status_code == 400 and too_small.json()["field"] == "limit"   # 1 over 2 shards: 0 in one
        assert "each needs at least 1" in too_small.json()["detail"]
        listed = httpx.get(f"{gateway.admin_url}/overrides/sale/stock").json()
        assert listed["count"] == 1 and listed["overrides"] == [{"key": "9", "token": "9", "override": {"limit": 10}}]
    finally:
        assert gateway.stop() == 0
