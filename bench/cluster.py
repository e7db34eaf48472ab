"""One hot route on Redis Cluster, unsharded and `shards: N`: Redis CPU per decision and its spread.

    .venv/bin/python bench/cluster.py                       # 1 and 3 primaries, shards 1 and 6
    .venv/bin/python bench/cluster.py --decisions 60000 --shards 12
    .venv/bin/python bench/cluster.py --binary /usr/bin/redis-server   # Debian's Redis 7

For each (primaries, shards): a fresh cluster of real redis-servers (the pip-shipped 6.2; one
primary owning all 16384 slots, or three from `redis-cli --cluster create`), every one of them pinned
to the last core and this load generator to the others, then `--decisions` decisions of the
seckill route (token_bucket per user, sliding_window and quota per item: both split when sharded)
from `--users` users through the gateway's own Limiter and RoutePlan. Per primary it reads
`INFO commandstats` (EVALSHA calls, usec) and `INFO cpu` (used_cpu_user + used_cpu_sys, the whole
process: script, networking, event loop) before and after.

On this 2-core box the primaries share one core, so wall-clock decisions/s do not scale with
primaries and are printed only as what this one Python client reached; what the run shows is
that the route's work, which sits on ONE primary unsharded, splits evenly over every primary when
sharded, at the same CPU per decision. Results print as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import RedisSettings, parse_config
from gateway.embedded import redis_server_binary
from gateway.keys import rule_key
from gateway.limiter import Limiter
from gateway.plan import RoutePlan, route_plan
from gateway.redis import make_runner
from tests.support.cluster import RedisCluster
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until

CORES = sorted(os.sched_getaffinity(0))
ROUTE = """
version: 1
routes:
  - name: seckill
    match: {{path: "/seckill/{{item}}"}}
    shards: {shards}
    limits:
      - {{name: user,  by: [header:X-User-Id], algorithm: token_bucket, rate: 100/s, burst: 100}}
      - {{name: item,  by: [path:item], algorithm: sliding_window, limit: 100000000, window: 1s}}
      - {{name: stock, by: [path:item], algorithm: quota, limit: 1000000000}}
"""


def plan(shards: int) -> RoutePlan:
    config = parse_config(ROUTE.format(shards=shards), "routes.yaml", {}, proxy=False)
    return route_plan(config.routes[0], "rlgw", None)


class OnePrimary(RedisCluster):
    """A cluster of one primary owning every slot (redis-cli wants three for `--cluster create`)."""

    def __init__(self, binary: str | None = None) -> None:
        super().__init__(size=1, binary=binary)

    def start(self) -> None:
        node = self.nodes[0]
        node.start()
        node.client().execute_command("CLUSTER", "ADDSLOTS", *range(16384))  # type: ignore[no-untyped-call]
        wait_until(self.healthy, timeout=30)


def primaries(cluster: RedisCluster) -> list[RedisProcess]:
    return [n for n in cluster.live() if n.client().execute_command("ROLE")[0] == b"master"]  # type: ignore[no-untyped-call]


def sample(node: RedisProcess) -> tuple[int, int, float, int, int]:
    """EVALSHA calls and usec, CPU seconds, used_memory bytes and keys of one primary."""
    client = node.client()
    stats = client.info("commandstats")
    calls = usec = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        calls += int(stats.get(name, {}).get("calls", 0))
        usec += int(stats.get(name, {}).get("usec", 0))
    cpu = client.info("cpu")
    memory = int(client.info("memory")["used_memory"])
    return calls, usec, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), memory, int(client.dbsize())


async def load(url: str, route: RoutePlan, count: int, users: int, concurrency: int, warm: int = 0) -> float:
    limiter = Limiter(make_runner(RedisSettings(url=url, mode="cluster", timeout=5.0)))
    numbers = iter(range(count))

    async def one(i: int) -> None:
        user = f"user-{i % users}".encode()
        item = f"item-{i % 50}".encode()
        shard = route.shard_of([user])
        prefixes = route.shard_prefix_keys[shard]
        keys = [rule_key(prefixes[0], [user], route.readable[0]), rule_key(prefixes[1], [item], route.readable[1]),
                rule_key(prefixes[2], [item], route.readable[2])]
        decision = await limiter.decide(route.shard_args[shard], keys, [1, 1, 1])
        assert decision.admitted

    async def worker() -> None:
        for i in numbers:
            await one(i)

    for i in range(warm):  # scripts loaded on every node, connections open
        await one(count + i)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await limiter.close()
    return elapsed


def measure(nodes: int, shards: int, count: int, users: int, concurrency: int,
            binary: str | None) -> dict[str, Any]:
    cluster: RedisCluster = OnePrimary(binary) if nodes == 1 else RedisCluster(size=nodes, binary=binary)
    cluster.start()
    try:
        for node in cluster.nodes:
            assert node.process is not None
            os.sched_setaffinity(node.process.pid, {CORES[-1]})
        os.sched_setaffinity(0, set(CORES[:-1]) or {CORES[0]})
        heads = primaries(cluster)
        route = plan(shards)
        asyncio.run(load(cluster.url, route, 0, 50, 1, warm=100))  # not counted: scripts, items
        before = [sample(n) for n in heads]
        elapsed = asyncio.run(load(cluster.url, route, count, users, concurrency))
        after = [sample(n) for n in heads]
    finally:
        cluster.stop()
    calls = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    usec = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    cpu = [a[2] - b[2] for a, b in zip(after, before, strict=True)]
    memory = sum(a[3] - b[3] for a, b in zip(after, before, strict=True))
    keys = sum(a[4] - b[4] for a, b in zip(after, before, strict=True))
    total = sum(calls)
    return {
        "bytes_per_key": memory / keys if keys else 0.0,
        "primaries": nodes,
        "shards": shards,
        "decisions": total,
        "per_s": count / elapsed,
        "script_us": sum(usec) / total,
        "cpu_us": sum(cpu) * 1e6 / total,
        "calls": calls,
        "share": [round(c / total, 3) for c in calls],
        "spread": max(calls) / max(1, min(calls)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=40_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--binary", default=None, help="redis-server to run (default: the pip-shipped 6.2)")
    args = parser.parse_args()
    version = subprocess.run([args.binary or redis_server_binary(), "--version"], capture_output=True,
                             text=True, check=True).stdout.split()[2]
    print(f"{args.decisions} decisions of a 3-rule route from {args.users} users; Redis {version} pinned to core "
          f"{CORES[-1]}, the client to {sorted(set(CORES[:-1]) or {CORES[0]})}\n")
    print("| primaries | shards | decisions/s (1 Python client) | EVALSHA µs/call | Redis CPU µs/decision "
          "| decisions per primary | max/min | bytes per new key |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for nodes in (1, 3):
        for shards in (1, args.shards):
            rows = [measure(nodes, shards, args.decisions, args.users, args.concurrency, args.binary)
                    for _ in range(args.rounds)]
            row = rows[0]
            spread = "—" if nodes == 1 else (f"{row['spread']:.2f}" if min(row["calls"]) else "all on one")
            print(f"| {nodes} | {shards} | {statistics.median(r['per_s'] for r in rows):,.0f} "
                  f"| {statistics.median(r['script_us'] for r in rows):.1f} "
                  f"| {statistics.median(r['cpu_us'] for r in rows):.1f} "
                  f"| {' / '.join(f'{c:,}' for c in row['calls'])} | {spread} "
                  f"| {statistics.median(r['bytes_per_key'] for r in rows):.0f} |", flush=True)


if __name__ == "__main__":
    main()
