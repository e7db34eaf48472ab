#!/usr/bin/env python3
"""protect: scope fleet against scope worker: two gateways in front of one upstream of fixed capacity
(tests/support/capacity_upstream.py: 4 served at once for 250 ms each, the rest queued), the load of
bench/protect.py split evenly between them (5 s of critical requests alone, 20 s of 3x the capacity of
sheddable ones beside them, 10 s after). Sampled every 0.2 s: the requests in the upstream (served and
queued) and the limits the gateways hold (fleet: the one in Redis; worker: the two gateways' summed).

Then what a slot in Redis costs: one gateway, a route without rules to a fast upstream, requests one
at a time; the answer time with scope worker and with scope fleet, and Redis's own time per script
call (INFO commandstats).

`python bench/protect_fleet.py --docs` writes the tables into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: the docs block)

from tests.support.capacity_upstream import CapacityUpstream  # noqa: E402
from tests.support.gateway_proc import GatewayProcess  # noqa: E402
from tests.support.overload import Run, Stream, answered, offer, percentile  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402
from tests.support.upstream import Upstream  # noqa: E402
from tests.test_protect import CRITICAL, OVERLOAD, PROTECT  # noqa: E402

CAPACITY, SERVICE = 4, 0.25
RATE = CAPACITY / SERVICE
WARM, LOAD, AFTER = 5.0, 20.0, 10.0
BEGIN, END = "<!-- bench/protect_fleet.py: begin -->", "<!-- bench/protect_fleet.py: end -->"
LIMITS = {scope: re.compile(rf'gateway_protect_{name}\{{route="\*",upstream="backend"\}} ([0-9.e+]+)')
          for scope, name in (("fleet", "fleet_limit"), ("worker", "limit"))}


def phases() -> list[tuple[float, list[Stream]]]:
    """Half of bench/protect.py's load: each gateway gets one."""
    critical = Stream("critical", 0.1 * RATE, CRITICAL)
    return [(WARM, [critical]), (LOAD, [Stream("sheddable", 1.5 * RATE), critical]),
            (AFTER, [Stream("sheddable", 0.125 * RATE), critical])]


async def sample(upstream: str, gateways: list[GatewayProcess], scope: str, until: float,
                 out: list[tuple[float, int, float]]) -> None:
    """(seconds, requests in the upstream, the limit the fleet holds) every 0.2 s."""
    origin = time.perf_counter()
    async with httpx.AsyncClient(timeout=5) as client:
        while time.perf_counter() - origin < until:
            try:
                in_system = (await client.get(upstream + "/stats")).json()["in_system"]
                limits = [float(m.group(1)) for g in gateways
                          for m in [LIMITS[scope].search((await client.get(g.admin_url + "/metrics")).text)] if m]
            except httpx.HTTPError:
                continue
            limit = max(limits, default=0.0) if scope == "fleet" else sum(limits)
            out.append((time.perf_counter() - origin, in_system, limit))
            await asyncio.sleep(0.2)


Samples = list[tuple[float, int, float]]


async def both(gateways: list[GatewayProcess], upstream: str, scope: str) -> tuple[list[Run], Samples]:
    samples: Samples = []
    runs = await asyncio.gather(
        *(offer(g.url + "/work", phases(), timeout=60) for g in gateways),
        sample(upstream, gateways, scope, WARM + LOAD + AFTER, samples))
    return [r for r in runs if isinstance(r, Run)], samples


def overload(redis_url: str, workdir: Path, scope: str) -> tuple[list[Run], list[tuple[float, int, float]]]:
    upstream = CapacityUpstream(CAPACITY, SERVICE)
    upstream.start()
    prefix = f"b{uuid.uuid4().hex[:8]}"
    text = OVERLOAD.format(prefix=prefix, upstream=upstream.url,
                           protect=PROTECT.replace("protect:", f"protect:\n      scope: {scope}"))
    gateways = []
    try:
        for i in range(2):
            (workdir / f"{scope}{i}").mkdir()
            gateway = GatewayProcess(text.replace("timeout: 30s", "timeout: 10s"), workdir / f"{scope}{i}",
                                     redis_url=redis_url)
            gateway.start()
            gateways.append(gateway)
        return asyncio.run(both(gateways, upstream.url, scope))
    finally:
        for gateway in gateways:
            gateway.stop()
        upstream.stop()


def overload_row(scope: str, runs: list[Run], samples: list[tuple[float, int, float]]) -> str:
    during = [(n, limit) for at, n, limit in samples if WARM + 2 <= at < WARM + LOAD]
    in_system = [n for n, _ in during]
    limits = [limit for _, limit in during]
    critical = [s for r in runs for s in r.of("critical", WARM, WARM + LOAD)]
    ok = [s.seconds for s in critical if s.status == 200]
    unloaded = percentile([s.seconds for r in runs for s in r.of("critical", 0, WARM)], 50)
    good = sum(answered(r, WARM + 2, WARM + LOAD) for r in runs)
    return (f"| {scope} | {statistics.median(limits):.1f} | {statistics.median(in_system):.0f} / "
            f"{percentile([float(n) for n in in_system], 90):.0f} / {max(in_system)} | {good / RATE:.0%} | "
            f"{len(ok) / len(critical):.0%} | {percentile(ok, 90) / unloaded:.1f}x |")


SIMPLE = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up:
    url: "{upstream}"
    protect: {{scope: {scope}, min_limit: 100, max_limit: 100}}
routes:
  - {{name: echo, match: {{path: /echo}}, upstream: up}}
"""


def evalsha(redis: RedisProcess) -> tuple[int, int]:
    stats = redis.client().info("commandstats")["cmdstat_evalsha"]
    return int(stats["calls"]), int(stats["usec"])


def cost(redis: RedisProcess, workdir: Path, n: int, rounds: int = 6) -> dict[str, tuple[float, float, float]]:
    """Per scope: the median answer time (µs), script calls per request and Redis's µs per call; the two
    gateways take turns, `rounds` batches each, so a busy moment of the machine falls on both."""
    upstream = Upstream()
    upstream.start()
    gateways = {}
    for scope in ("worker", "fleet"):
        (workdir / f"cost-{scope}").mkdir()
        gateways[scope] = GatewayProcess(SIMPLE.format(prefix=f"c{uuid.uuid4().hex[:8]}", upstream=upstream.url,
                                                       scope=scope), workdir / f"cost-{scope}", redis_url=redis.url)
        gateways[scope].start()
    times: dict[str, list[float]] = {scope: [] for scope in gateways}
    calls = {scope: [0, 0] for scope in gateways}
    try:
        with httpx.Client() as client:
            for _ in range(rounds):
                for scope, gateway in gateways.items():
                    for _ in range(50):
                        client.get(gateway.url + "/echo")
                    time.sleep(0.1)  # the give-backs of the warm-up
                    before = evalsha(redis)
                    for _ in range(n // rounds):
                        started = time.perf_counter()
                        client.get(gateway.url + "/echo")
                        times[scope].append(time.perf_counter() - started)
                    time.sleep(0.1)  # the last give-backs
                    after = evalsha(redis)
                    calls[scope][0] += after[0] - before[0]
                    calls[scope][1] += after[1] - before[1]
    finally:
        for gateway in gateways.values():
            gateway.stop()
        upstream.stop()
    return {scope: (statistics.median(times[scope]) * 1e6, calls[scope][0] / len(times[scope]),
                    calls[scope][1] / calls[scope][0] if calls[scope][0] else 0.0) for scope in gateways}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", action="store_true", help="write docs/benchmarks.md's block")
    parser.add_argument("--requests", type=int, default=3000, help="requests one at a time per scope (cost)")
    parser.add_argument("--cost-only", action="store_true", help="measure only what a slot in Redis costs")
    args = parser.parse_args()
    redis = RedisProcess()
    redis.start()
    rows, costs = [], []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for scope in () if args.cost_only else ("fleet", "worker"):
                rows.append(overload_row(scope, *overload(redis.url, Path(scratch), scope)))
            for scope, (answer, calls, usec) in cost(redis, Path(scratch), args.requests).items():
                shown = f"{usec:.1f}" if calls >= 0.5 else "-"
                costs.append(f"| {scope} | {answer:.0f} | {calls:.2f} | {shown} |")
    finally:
        redis.stop()
    lines = ["| scope | limit held (median; worker: the two summed) | requests in the upstream: median / p90 / "
             "most | goodput / capacity | critical answered 200 | critical p90 / unloaded |",
             "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, "",
             "What a slot in Redis costs, one request at a time (no rules; a fast upstream):", "",
             "| scope | answer time, median (µs) | Redis script calls per request | Redis's µs per call |",
             "| --- | ---: | ---: | ---: |", *costs]
    print("\n".join(lines))
    if args.docs:
        run.write_doc_block(BEGIN, END, "Protecting the upstream: two gateways, scope fleet and scope worker",
                            "python bench/protect_fleet.py --docs",
                            f"two gateways of one worker, an upstream of {CAPACITY} x {SERVICE * 1000:.0f} ms, "
                            f"bench/protect.py's load split between them", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
