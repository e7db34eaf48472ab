"""Live resharding on a real Redis Cluster: a route's slot moves from one primary to another, key by
key, while decisions run against it. No decision fails and the quota admits exactly its limit.

While the slot migrates, a decision's keys may be on the source, on the target or split between
them: the source answers ASK for keys it no longer has, the target TRYAGAIN for a call whose keys
it has only some of, and once the slot is the target's, the source answers MOVED. Every one of
those is sent again by the runner (gateway/redis/cluster.py), within the decision's time budget.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

from redis.crc import key_slot

from gateway.config import RedisSettings, Rule, Source
from gateway.errors import RedisUnavailable
from gateway.keys import state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import ClusterRunner, make_runner
from tests.support.cluster import RedisCluster
from tests.support.patience import within

LIMIT = 300
RULES = [
    Rule("user", (Source("header", "x-user"),), "token_bucket", rate=1.0, burst=50),  # never the one refusing
    Rule("stock", (), "quota", limit=LIMIT),
]
FILLER = 1500  # other keys of the route's slot, so that migrating it takes a while
BATCH = 10     # keys per MIGRATE


def _migrate(cluster: RedisCluster, slot: int, started: threading.Event, done: threading.Event) -> None:
    cluster.migrate_slot(slot, started, BATCH)
    done.set()


def test_a_slot_migrating_under_load_costs_no_error_and_no_over_admission(cluster: RedisCluster) -> None:
    route = f"reshard-{uuid.uuid4().hex[:6]}"
    stock_key = state_key("rlgw", route, "stock", "~")
    slot = key_slot(stock_key.encode())
    before = cluster.owner_of_slot(slot)
    filler = before.client().pipeline(transaction=False)
    for i in range(FILLER):
        filler.set(state_key("rlgw", route, "filler", str(i)), b"x")
    filler.execute()
    specs = [rule_spec(r) for r in RULES]
    started, done = threading.Event(), threading.Event()

    async def run() -> tuple[int, int, int, dict[str, int]]:
        runner = make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=5.0))
        assert isinstance(runner, ClusterRunner)
        limiter = Limiter(runner)
        counts = {"admitted": 0, "refused": 0, "errors": 0}
        numbers = iter(range(1_000_000))
        after_done = 0

        async def worker() -> None:
            nonlocal after_done
            for i in numbers:
                if done.is_set():
                    after_done += 1
                    if after_done > 300:  # enough calls after the switch to meet MOVED
                        return
                keys = [state_key("rlgw", route, "user", f"u{i % 700}"), stock_key]
                try:
                    decision = await limiter.decide(specs, keys, [1, 1])
                except RedisUnavailable:
                    counts["errors"] += 1
                else:
                    counts["admitted" if decision.admitted else "refused"] += 1
                    flowing.set()
                await asyncio.sleep(0.01)

        flowing = asyncio.Event()
        workers = [asyncio.create_task(worker()) for _ in range(40)]
        await asyncio.wait_for(flowing.wait(), within(10))  # decisions flowing (the script loaded) before the move
        mover = threading.Thread(target=_migrate, args=(cluster, slot, started, done))
        mover.start()
        await asyncio.gather(*workers)
        mover.join()
        await limiter.close()
        return counts["admitted"], counts["refused"], counts["errors"], dict(runner.redirects)

    admitted, refused, errors, redirects = asyncio.run(run())
    after = cluster.owner_of_slot(slot)
    print(f"admitted {admitted}, refused {refused}, errors {errors}, sent again: {redirects}")
    assert after.port != before.port
    assert errors == 0
    assert admitted == LIMIT  # exactly: never more, and no admission lost to a failed call
    assert refused > 0
    assert after.client().get(stock_key) == str(LIMIT).encode()
    assert before.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0  # every key moved
    assert redirects.get("ask", 0) > 0 and redirects.get("moved", 0) > 0
