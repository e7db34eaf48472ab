"""Per-identity overrides: the Redis cost of a decision with overrides present, and memory per override.

    .venv/bin/python bench/overrides.py
    .venv/bin/python bench/overrides.py --overrides 100000 --decisions 14000
    .venv/bin/python bench/overrides.py --instructions   # and instructions per decision (callgrind)

The route is bench/engine.py's three rules (token_bucket per user, sliding_window per item, quota
per item); `user` gets N overrides (distinct users, a handful of distinct numbers), stored through
the admin's own store (gateway/overrides.py, one script call each). Redis CPU per decision is
`INFO commandstats` usec_per_call of EVALSHA, the median of seven rounds taken in turn:

    without     users with no override, before any override exists
    present     the same users, with N overrides on the rule (the file's script, as ever)
    overridden  users that have an override (the route's script with the numbers in ARGV)

Time on a shared host moves with its load; `--instructions` also counts the instructions redis-server
runs per decision of each kind under callgrind (bench/engine.py's method), which does not.

Memory: Redis `used_memory` before and after storing them, per override; a worker's, traced
(tracemalloc) while it reads them all and builds its table (gateway.overrides.Overrides.sync), per
override, and how long that first read takes. redis-server runs pinned to one core, this process to
the other(s). Results print as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import instructions_per_call  # bench/engine.py, beside this file

from gateway.config import RedisSettings, parse_config
from gateway.keys import identity_token, state_key
from gateway.limiter import Limiter, RuleSpec
from gateway.override_sync import Overrides
from gateway.overrides import Store, canonical, entry
from gateway.redis import make_runner
from gateway.runtime import build_runtime
from tests.support.redis_proc import RedisProcess

ROUNDS = 7
CORES = sorted(os.sched_getaffinity(0))
USERS = 5000
PLANS: list[dict[str, Any]] = [{"rate": "200/s", "burst": 200}, {"rate": "1000/s", "burst": 500},
                               {"rate": "50/s", "burst": 50}]
CONFIG = """
version: 1
routes:
  - name: shop
    match: {path: "/items/{item}"}
    limits:
      - {name: user, by: [header:x-user], algorithm: token_bucket, rate: 100/s, burst: 100, max_overrides: 1000000}
      - {name: item, by: [path:item], algorithm: sliding_window, limit: 1000000, window: 1s}
      - {name: stock, by: [path:item], algorithm: quota, limit: 1000000000}
"""


def pin(proc: RedisProcess) -> None:
    """redis-server on the last core, this process on the others (as bench/engine.py)."""
    if len(CORES) >= 2 and proc.process is not None:
        os.sched_setaffinity(proc.process.pid, {CORES[-1]})
        os.sched_setaffinity(0, set(CORES[:-1]))


def route_keys(i: int, user: str = "user") -> list[str]:
    """The keys of decision number i: its user's bucket, its item's window and stock."""
    who = identity_token([f"{user}-{i % USERS}".encode()], False)
    item = identity_token([f"item-{i % 50}".encode()], True)
    return [state_key("rlgw", "shop", "user", who), state_key("rlgw", "shop", "item", item),
            state_key("rlgw", "shop", "stock", item)]


async def store_overrides(url: str, count: int) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    store = Store(limiter, "rlgw")
    batch = 500
    for start in range(0, count, batch):
        await asyncio.gather(*(
            store.put("shop", "user", identity_token([f"vip-{i}".encode()], False), canonical(PLANS[i % 3]), 1_000_000)
            for i in range(start, min(start + batch, count))))
    await limiter.close()


async def decide_rounds(url: str, count: int, args: tuple[RuleSpec, ...], user: str) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    for start in range(0, count, 200):
        await asyncio.gather(*(limiter.decide(args, route_keys(i, user), [1, 1, 1])
                               for i in range(start, min(start + 200, count))))
    await limiter.close()


def usec(client: object, url: str, count: int, args: tuple[RuleSpec, ...], user: str) -> float:
    client.config_resetstat()  # type: ignore[attr-defined]
    asyncio.run(decide_rounds(url, count, args, user))
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--overrides", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=14_000)
    parser.add_argument("--instructions", action="store_true", help="also count instructions (callgrind: minutes)")
    opts = parser.parse_args()
    proc = RedisProcess()
    proc.start()
    try:
        client = proc.client()
        config = parse_config(CONFIG, "bench", {}, proxy=False)
        runtime = build_runtime(config, RedisSettings(url=proc.url, timeout=5.0),
                                Limiter(make_runner(RedisSettings(url=proc.url, timeout=5.0))))
        plan = runtime.plans["shop"]
        override = entry(plan, 0, canonical(PLANS[0]))
        assert override.rule is not None
        overridden = (override.specs[0], *plan.args[1:])
        per_round = opts.decisions // ROUNDS
        asyncio.run(decide_rounds(proc.url, 2000, plan.args, "user"))
        asyncio.run(decide_rounds(proc.url, 2000, overridden, "vip"))
        pin(proc)
        constants = (override.specs[0]._replace(base=None), *plan.args[1:])

        def rounds() -> tuple[float, float, float]:
            """Medians of the file's script, the ARGV script, the constants' script, in turn."""
            plain, argv, consts = [], [], []
            for _ in range(ROUNDS):
                plain.append(usec(client, proc.url, per_round, plan.args, "user"))
                argv.append(usec(client, proc.url, per_round, overridden, "vip"))
                consts.append(usec(client, proc.url, per_round, constants, "vip"))
            return statistics.median(plain), statistics.median(argv), statistics.median(consts)

        empty = rounds()
        before = int(client.info("memory")["used_memory"])
        started = time.perf_counter()
        asyncio.run(store_overrides(proc.url, opts.overrides))
        stored_s = time.perf_counter() - started
        redis_bytes = (int(client.info("memory")["used_memory"]) - before) / opts.overrides
        full = rounds()

        async def worker() -> tuple[float, float, float, float]:
            """A worker's first read (s), its memory per override (bytes, traced in a second read),
            a sync after one override changed (s), and a reload's rebuild of the table (s: the
            event loop is blocked that long)."""
            began = time.perf_counter()
            await Overrides().sync(runtime)
            first = time.perf_counter() - began
            assert len(runtime.overrides["shop"][0]) == opts.overrides
            overrides = Overrides()
            tracemalloc.start()
            await overrides.sync(runtime)
            held, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            store = Store(runtime.limiter, "rlgw")
            await store.put("shop", "user", identity_token([b"vip-0"], False), canonical(PLANS[1]), 1_000_000)
            began = time.perf_counter()
            await overrides.sync(runtime)
            again = time.perf_counter() - began
            began = time.perf_counter()
            overrides.apply(runtime)
            rebuild = time.perf_counter() - began
            await runtime.limiter.close()
            return first, held / opts.overrides, again, rebuild

        read_s, worker_bytes, again_s, rebuild_s = asyncio.run(worker())
        counted: list[float] = []
        if opts.instructions:
            for args, user in ((plan.args, "user"), (overridden, "vip"), (constants, "vip")):
                def work(url: str, n: int, args: tuple[RuleSpec, ...] = args, user: str = user) -> None:
                    asyncio.run(decide_rounds(url, n, args, user))
                counted.append(instructions_per_call(proc.binary, work))
        client.close()
    finally:
        proc.stop()
    n = opts.overrides
    print(f"| Redis CPU per decision, µs (EVALSHA usec_per_call, median of {ROUNDS}) | no overrides stored "
          f"| {n} on rule `user` |")
    print("| --- | --- | --- |")
    print(f"| identity without an override (the file's script) | {empty[0]:.2f} | {full[0]:.2f} |")
    print(f"| identity with one (its numbers in ARGV) | {empty[1]:.2f} | {full[1]:.2f} |")
    print(f"| the same numbers as constants (what ARGV itself costs) | {empty[2]:.2f} | {full[2]:.2f} |")
    print()
    print("| memory and time | value |")
    print("| --- | --- |")
    for kind, count in zip(("the file's script", "an override's, numbers in ARGV", "the same as constants"),
                           counted, strict=False):
        print(f"| redis-server instructions per decision (callgrind), {kind} | {count:.0f} |")
    print(f"| Redis memory per override, bytes (used_memory) | {redis_bytes:.0f} |")
    print(f"| worker memory per override, bytes (tracemalloc, table and stored text) | {worker_bytes:.0f} |")
    print(f"| storing them through the admin's store (500 in flight), s | {stored_s:.1f} |")
    print(f"| a worker's first read of all of them (HSCAN pages of 1000) and table, s | {read_s:.2f} |")
    print(f"| a worker's sync after one of them changed (the change read alone), ms | {again_s * 1000:.1f} |")
    print(f"| a reload's table rebuilt from the texts held (the event loop blocked), ms | {rebuild_s * 1000:.0f} |")


if __name__ == "__main__":
    main()
