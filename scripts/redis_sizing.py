"""Numbers for running the shared Redis (docs/deploy.md, "Running Redis for it"), measured on real
redis-servers started here:

    .venv/bin/python scripts/redis_sizing.py            # the pip-shipped Redis 6.2
    .venv/bin/python scripts/redis_sizing.py --binary /usr/bin/redis-server

1. sliding_log memory per identity, filled to its limit (the O(1) algorithms are in bench/engine.py);
2. decisions per second of Redis CPU: a 3-rule route (token_bucket per user, sliding_window and quota
   per item), pipelined, divided by the server's own used_cpu_user + used_cpu_sys;
3. what a failover costs: a primary and an asynchronous replica, decisions on one quota in flight,
   the primary killed (SIGKILL), the replica promoted; admissions the gateway saw acknowledged that
   the replica never received are the requests a failover re-admits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import RedisSettings, Rule, Source
from gateway.errors import RedisUnavailable
from gateway.keys import identity_token, state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until

ROUTE = [
    Rule("user", (Source("header", "x-user"),), "token_bucket", rate=100.0, burst=100),
    Rule("item", (Source("path", "item"),), "sliding_window", limit=1_000_000, window=1.0),
    Rule("stock", (Source("path", "item"),), "quota", limit=1_000_000_000),
]
STOCK = Rule("stock", (), "quota", limit=1_000_000_000)


def limiter(url: str) -> Limiter:
    return Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))


def route_keys(i: int) -> list[str]:
    user = identity_token([f"user-{i % 5000}".encode()], ROUTE[0].readable_identity)
    item = identity_token([f"item-{i % 50}".encode()], ROUTE[1].readable_identity)
    return [state_key("rlgw", "shop", "user", user), state_key("rlgw", "shop", "item", item),
            state_key("rlgw", "shop", "stock", item)]


async def sliding_log_fill(url: str, limit: int, identities: int) -> None:
    rule = Rule("r", (Source("header", "x-user"),), "sliding_log", limit=limit, window=86400.0)
    lim, args = limiter(url), [rule_spec(rule)]
    for start in range(0, identities, 500):
        for _ in range(limit):
            await asyncio.gather(*[
                lim.decide(args, [state_key("rlgw", "api", "r", identity_token([f"u{i}".encode()], False))], [1])
                for i in range(start, min(start + 500, identities))])
    await lim.runner.close()


async def route_decisions(url: str, count: int) -> None:
    lim, args = limiter(url), [rule_spec(r) for r in ROUTE]
    for start in range(0, count, 200):
        await asyncio.gather(*[lim.decide(args, route_keys(i), [1, 1, 1]) for i in range(start, start + 200)])
    await lim.runner.close()


def cpu_seconds(proc: RedisProcess) -> float:
    info = proc.client().info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def failover_once(binary: str | None, run_for: float) -> tuple[int, int]:
    """(admissions acknowledged to the gateway, of them missing on the promoted replica)."""
    primary, replica = RedisProcess(binary), RedisProcess(binary)
    primary.start()
    replica.start()
    try:
        replica.client().replicaof("127.0.0.1", primary.port)
        wait_until(lambda: replica.client().info("replication").get("master_link_status") == "up", timeout=10)
        lim, args, key = limiter(primary.url), [rule_spec(STOCK)], state_key("rlgw", "sale", "stock", "~")
        admitted = 0
        deadline = time.monotonic() + run_for
        killed = False
        while not killed:
            if time.monotonic() >= deadline:
                assert primary.process is not None
                primary.process.kill()  # with a batch of 200 decisions in flight
                killed = True
            results = await asyncio.gather(*[lim.decide(args, [key], [1]) for _ in range(200)],
                                           return_exceptions=True)
            admitted += sum(1 for r in results if not isinstance(r, BaseException) and r.admitted)
            if any(isinstance(r, RedisUnavailable) for r in results):
                killed = True
                with contextlib.suppress(Exception):
                    assert primary.process is not None
                    primary.process.kill()
        await lim.runner.close()
        replica.client().replicaof("NO", "ONE")
        promoted = limiter(replica.url)
        state = (await promoted.decide(args, [key], [0], peek=True)).rules[0]
        await promoted.runner.close()
        applied = STOCK.limit - state.remaining
        return admitted, admitted - applied
    finally:
        replica.stop()
        primary.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", help="redis-server to measure (default: the pip-shipped one)")
    parser.add_argument("--decisions", type=int, default=60_000)
    parser.add_argument("--failovers", type=int, default=5)
    args = parser.parse_args()

    proc = RedisProcess(args.binary)
    proc.start()
    try:
        client = proc.client()
        print(f"redis-server {client.info('server')['redis_version']}, {os.cpu_count()} cores")
        for limit, identities in ((1, 20_000), (10, 5_000), (100, 1_000)):
            client.flushall()
            before = client.info("memory")["used_memory"]
            asyncio.run(sliding_log_fill(proc.url, limit, identities))
            after = client.info("memory")["used_memory"]
            print(f"sliding_log limit {limit:>3}: {(after - before) / identities:8.0f} bytes per identity "
                  f"({identities} identities, each at its limit)")
        client.flushall()
        asyncio.run(route_decisions(proc.url, 2000))  # load the script
        rates = []
        for _ in range(3):
            cpu, wall = cpu_seconds(proc), time.perf_counter()
            asyncio.run(route_decisions(proc.url, args.decisions))
            cpu, wall = cpu_seconds(proc) - cpu, time.perf_counter() - wall
            rates.append(args.decisions / cpu)
            print(f"3-rule decisions: {args.decisions / cpu:9.0f} per Redis CPU-second "
                  f"({args.decisions / wall:7.0f}/s wall clock, client-bound here)")
        print(f"median: {statistics.median(rates):.0f} decisions per Redis CPU-second")
    finally:
        proc.stop()

    for _ in range(args.failovers):
        admitted, lost = asyncio.run(failover_once(args.binary, 1.0))
        print(f"failover: {admitted} admissions acknowledged, {lost} missing on the promoted replica "
              "(re-admitted after the failover)")


if __name__ == "__main__":
    main()
