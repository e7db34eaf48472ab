"""`shards: N` on a real Redis Cluster: three primaries, each with a replica.

A sharded route's decisions land on every primary, each still ONE script call whose keys share one
hash tag; racing gateway processes never admit more than a split rule allows (exactly its limit once
every shard's demand passes its share); a primary failover and a slot migration in the middle of a
run cost no 500 and no over-admission beyond docs/scaling.md's statement.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.crc import key_slot

from gateway.config import RedisSettings, parse_config
from gateway.errors import RedisUnavailable
from gateway.keys import rule_key
from gateway.limiter import Limiter
from gateway.plan import RoutePlan, route_plan
from gateway.redis import ClusterRunner, make_runner
from tests.support.cluster import RedisCluster
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

GATEWAYS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three primaries and three replicas of real processes (conftest's has no replicas)."""
    c = RedisCluster(replicas=1)
    c.start()
    yield c
    c.stop()


def _plan(shards: int, stock: int, prefix: str, route: str = "sale", rate: str = "1/s") -> RoutePlan:
    text = f"""
version: 1
routes:
  - name: {route}
    match: {{path: "/sale/{{item}}"}}
    shards: {shards}
    limits:
      - {{name: user,  by: [header:X-User], algorithm: gcra, rate: {rate}, burst: 50}}
      - {{name: stock, by: [path:item], algorithm: quota, limit: {stock}}}
"""
    config = parse_config(text, "routes.yaml", {}, proxy=False)
    return route_plan(config.routes[0], prefix, None)


async def _decide(limiter: Limiter, plan: RoutePlan, user: str, item: str = "9") -> bool:
    """What gateway.pipeline.decide does for this route: the user's shard, its keys, one call."""
    shard = plan.shard_of([user.encode()])
    prefixes = plan.shard_prefix_keys[shard]
    keys = [rule_key(prefixes[0], [user.encode()], plan.readable[0]),
            rule_key(prefixes[1], [item.encode()], plan.readable[1])]
    return (await limiter.decide(plan.shard_args[shard], keys, [1, 1])).admitted


def _script_calls(node: RedisProcess) -> int:
    stats = node.client().info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def _keys(node: RedisProcess, prefix: str) -> int:
    return sum(1 for _ in node.client().scan_iter(match=f"{prefix}:*", count=1000))


def test_a_sharded_route_spreads_keys_and_script_calls_over_every_primary(cluster: RedisCluster) -> None:
    primaries = cluster.primaries()
    assert len(primaries) == 3

    def run(shards: int) -> tuple[list[int], list[int], int]:
        prefix = f"s{uuid.uuid4().hex[:6]}"
        # a user's key lives until its bucket is full again: a request's worth of the rate. At 1/s the
        # first users' keys were gone before a busy machine had made the 3,000 decisions (2,806 left)
        plan = _plan(shards, 1_000_000, prefix, rate="1/h")
        for node in primaries:
            node.client().config_resetstat()

        async def main() -> int:
            limiter = Limiter(make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=2.0)))
            admitted = 0
            for start in range(0, 3000, 100):
                batch = [_decide(limiter, plan, f"u{i}") for i in range(start, start + 100)]
                admitted += sum(await asyncio.gather(*batch))
            await limiter.close()
            return admitted

        admitted = asyncio.run(main())
        return [_script_calls(n) for n in primaries], [_keys(n, prefix) for n in primaries], admitted

    calls, keys, admitted = run(6)
    print(f"shards: 6 -> script calls per primary {calls}, keys {keys}")
    assert admitted == 3000
    assert sum(calls) >= 3000  # (EVAL once per node and script, EVALSHA after)
    assert min(calls) > 0 and max(calls) <= 2 * min(calls)
    assert min(keys) > 0 and max(keys) <= 2 * min(keys)
    assert sum(keys) == 3000 + 6  # a user key per user, a stock key per shard

    calls, keys, _ = run(1)
    print(f"shards: 1 -> script calls per primary {calls}, keys {keys}")
    assert sorted(calls)[:2] == [0, 0] and sorted(keys) == [0, 0, 3001]  # one slot, one primary


def _sale_config(cluster: RedisCluster, upstream: Upstream, prefix: str, failure_mode: str = "closed") -> str:
    return f"""
    version: 1
    redis: {{url: "{cluster.url}", mode: cluster, timeout: 500ms, key_prefix: {prefix}}}
    defaults: {{failure_mode: {failure_mode}}}
    upstreams: {{up: {{url: "{upstream.url}"}}}}
    routes:
      - name: sale
        match: {{path: "/echo/sale/{{item}}"}}
        upstream: up
        shards: 6
        limits:
          - {{name: user,  by: [header:X-User], algorithm: gcra, rate: 1/s, burst: 5}}
          - {{name: stock, by: [path:item], algorithm: quota, limit: 120}}
      - name: exact
        match: {{path: "/echo/exact/{{item}}"}}
        upstream: up
        limits:
          - {{name: user,  by: [header:X-User], algorithm: gcra, rate: 1/s, burst: 5}}
          - {{name: stock, by: [path:item], algorithm: quota, limit: 120}}
    """


async def _flood(urls: list[str], path: str, users: int, per_user: int, concurrency: int = 64,
                 first_user: int = 0) -> Counter[int]:
    """`users` users, `per_user` requests each, spread round-robin over the gateways."""
    statuses: Counter[int] = Counter()
    jobs = iter([(i, j) for j in range(per_user) for i in range(first_user, first_user + users)])
    clients = [httpx.AsyncClient(base_url=url, timeout=10) for url in urls]

    async def worker(w: int) -> None:
        for i, _ in jobs:
            client = clients[(i + w) % len(clients)]
            response = await client.get(path, headers={"X-User": f"u{i}"})
            statuses[response.status_code] += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    for client in clients:
        await client.aclose()
    return statuses


def test_eight_gateways_racing_never_admit_more_than_the_split_quota(
    cluster: RedisCluster, upstream: Upstream, tmp_path: Path
) -> None:
    prefix = f"g{uuid.uuid4().hex[:6]}"
    config = _sale_config(cluster, upstream, prefix)
    gateways = []
    for g in range(GATEWAYS):
        workdir = tmp_path / f"gw{g}"
        workdir.mkdir()
        gateways.append(GatewayProcess(config, workdir))
    try:
        for gateway in gateways:
            gateway.start(ready=False)
        for gateway in gateways:
            deadline = time.monotonic() + 60
            while not gateway.ready():
                assert time.monotonic() < deadline, gateway.log()
                time.sleep(0.1)
        urls = [g.url for g in gateways]
        # 600 users, 2 requests each: every shard's demand (about 200) passes its share (20)
        sharded = asyncio.run(_flood(urls, "/echo/sale/9", 600, 2))
        exact = asyncio.run(_flood(urls, "/echo/exact/9", 600, 2))
        print(f"shards: 6 -> {dict(sharded)}; shards: 1 -> {dict(exact)}")
        assert sharded[200] == 120 and sharded[429] == 1080 and sum(sharded.values()) == 1200
        assert exact[200] == 120 and exact[429] == 1080 and sum(exact.values()) == 1200

        admin = gateways[3].admin_url
        listed = {r["name"]: r for r in httpx.get(f"{admin}/limits").json()["routes"]}
        assert listed["sale"]["shards"] == 6 and [r["split"] for r in listed["sale"]["rules"]] == [False, True]
        assert listed["exact"]["shards"] == 1 and all("split" not in r for r in listed["exact"]["rules"])
        state = httpx.get(f"{admin}/limits/sale/stock", params={"key": "9"}).json()
        assert state["limit"] == 120 and state["remaining"] == 0 and state["exhausted"]
        assert state["shards"] == 6 and state["split"] is True
        assert [s["limit"] for s in state["per_shard"]] == [20] * 6
        assert len({s["key"] for s in state["per_shard"]}) == 6
        user = httpx.get(f"{admin}/limits/sale/user", params={"key": "u7"}).json()
        assert user["split"] is False and user["limit"] == 5 and 3 <= user["remaining"] <= 5
        assert user["shard"] == _plan(6, 120, prefix).shard_of([b"u7"])
        reset = httpx.delete(f"{admin}/limits/sale/stock", params={"key": "9"}).json()
        assert reset["reset"] is True and reset["reset_shards"] == 6
        after = httpx.get(f"{admin}/limits/sale/stock", params={"key": "9"}).json()
        assert after["remaining"] == 120
        assert httpx.get(f"{urls[0]}/echo/sale/9", headers={"X-User": "fresh"}).status_code == 200
    finally:
        stopped = [gateway.stop() for gateway in gateways]  # every one, whatever happened above
    assert stopped == [0] * GATEWAYS


def _stock_total(cluster: RedisCluster, prefix: str) -> int:
    total = 0
    for node in cluster.primaries():
        for key in node.client().scan_iter(match=f"{prefix}:*:stock:*", count=1000):
            total += int(node.client().get(key) or 0)
    return total


def test_a_primary_failover_mid_run_costs_no_500_and_no_over_admission(upstream: Upstream, tmp_path: Path) -> None:
    """A primary owning two of the six shards is killed while three gateways (failure_mode: closed)
    take a flood: its shards answer 503 until the replica is promoted, never 500; the route
    admits at most its quota plus the admissions the dead primary acknowledged but had not yet
    replicated (docs/scaling.md, "Failover"), counted here from what the cluster kept."""
    c = RedisCluster(replicas=1)
    c.start()
    prefix = f"f{uuid.uuid4().hex[:6]}"
    gateways = []
    try:
        config = _sale_config(c, upstream, prefix).replace("limit: 120}", "limit: 600}", 1)
        for g in range(3):
            workdir = tmp_path / f"gw{g}"
            workdir.mkdir()
            gateways.append(GatewayProcess(config, workdir))
            gateways[-1].start()
        plan = _plan(6, 600, prefix)
        victim = c.owner_of(plan.shard_prefix_keys[0][1] + "9")
        replica = c.replica_of(victim)
        killed, flowing = threading.Event(), threading.Event()

        def kill() -> None:
            assert flowing.wait(60), "the flood never got going"
            assert victim.process is not None
            victim.process.kill()
            victim.process.wait()
            killed.set()

        killer = threading.Thread(target=kill)
        killer.start()
        urls = [g.url for g in gateways]

        async def run() -> Counter[int]:
            statuses: Counter[int] = Counter()
            deadline = time.monotonic() + 40
            batches = 0
            recovered_at = None
            while time.monotonic() < deadline:
                batch = await _flood(urls, "/echo/sale/9", 120, 1, concurrency=24, first_user=batches * 120)
                batches += 1
                statuses.update(batch)
                flowing.set()  # a batch answered: the primary dies mid-run
                if killed.is_set() and batch[503] == 0:
                    recovered_at = recovered_at or time.monotonic()
                    if time.monotonic() - recovered_at > 1.0:
                        break
                await asyncio.sleep(0.05)
            return statuses

        statuses = asyncio.run(run())
        killer.join()
        kept = _stock_total(c, prefix)
        lost = max(0, statuses[200] - kept)
        print(f"statuses {dict(statuses)}; counted by the cluster {kept}; acknowledged but lost {lost}")
        assert set(statuses) <= {200, 429, 503}  # no 500, no 502
        assert statuses[503] > 0  # the dead primary's shards did fail closed for a while
        assert c.owner_of(plan.shard_prefix_keys[0][1] + "9").port == replica.port
        assert kept <= 600
        assert statuses[200] <= 600 + lost
        assert lost <= 6  # the replication lag of a local replica: a few decisions at most
    finally:
        for gateway in gateways:
            gateway.stop()
        c.stop()


def _migrate(cluster: RedisCluster, slot: int, done: threading.Event) -> None:
    cluster.migrate_slot(slot)
    done.set()


def test_a_shard_slot_migrating_mid_run_costs_no_error_and_no_over_admission(cluster: RedisCluster) -> None:
    prefix = f"m{uuid.uuid4().hex[:6]}"
    limit = 300
    plan = _plan(3, limit, prefix, route=f"moving{uuid.uuid4().hex[:4]}")
    stock_key = plan.shard_prefix_keys[0][1] + "9"
    slot = key_slot(stock_key.encode())
    before = cluster.owner_of_slot(slot)
    filler = before.client().pipeline(transaction=False)
    for i in range(1500):  # other keys of shard 0's slot, so that migrating it takes a while
        filler.set(plan.shard_prefix_keys[0][0] + f"filler{i}", b"x")
    filler.execute()
    done = threading.Event()

    async def run() -> tuple[int, int, int, dict[str, int]]:
        runner = make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=5.0))
        assert isinstance(runner, ClusterRunner)
        limiter = Limiter(runner)
        counts = Counter[str]()
        numbers = iter(range(1_000_000))
        after_done = 0

        async def worker() -> None:
            nonlocal after_done
            for i in numbers:
                if done.is_set():
                    after_done += 1
                    if after_done > 300:
                        return
                try:
                    admitted = await _decide(limiter, plan, f"u{i % 3000}")
                except RedisUnavailable:
                    counts["errors"] += 1
                else:
                    counts["admitted" if admitted else "refused"] += 1
                    flowing.set()
                await asyncio.sleep(0.01)

        flowing = asyncio.Event()
        workers = [asyncio.create_task(worker()) for _ in range(40)]
        await asyncio.wait_for(flowing.wait(), within(10))  # decisions flowing before the move
        mover = threading.Thread(target=_migrate, args=(cluster, slot, done))
        mover.start()
        await asyncio.gather(*workers)
        mover.join()
        await limiter.close()
        return counts["admitted"], counts["refused"], counts["errors"], dict(runner.redirects)

    admitted, refused, errors, redirects = asyncio.run(run())
    print(f"admitted {admitted}, refused {refused}, errors {errors}, sent again: {redirects}")
    assert cluster.owner_of_slot(slot).port != before.port
    assert errors == 0
    assert admitted == limit  # every shard's share spent, none exceeded, none lost to the move
    assert cluster.owner_of_slot(slot).client().get(stock_key) == b"100"
    assert redirects.get("ask", 0) + redirects.get("moved", 0) > 0
