#!/usr/bin/env python3
"""Protecting the upstream, side by side: the same overload through a gateway with `protect:` and
through one without, one after the other, each in front of its own fresh upstream of fixed capacity
(tests/support/capacity_upstream.py: 4 served at once for 250 ms each, the rest queued: 16 answers a
second). The load (tests/support/overload.py, open loop):

- 5 s of critical requests alone (20% of the capacity): the unloaded answer time;
- 20 s of 3x the capacity of sheddable requests, the critical stream going on;
- 10 s after it: sheddable requests at a quarter of the capacity, the critical stream going on.

`python bench/protect.py --docs` writes the table into docs/benchmarks.md and the plot of goodput and
critical p90 over time into docs/protect.png.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: the docs block)

from tests.support.capacity_upstream import CapacityUpstream  # noqa: E402
from tests.support.gateway_proc import GatewayProcess  # noqa: E402
from tests.support.overload import Run, Stream, answered, offer, percentile  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402
from tests.test_protect import CRITICAL, OVERLOAD, PROTECT  # noqa: E402

CAPACITY, SERVICE = 4, 0.25
RATE = CAPACITY / SERVICE
WARM, LOAD, AFTER = 5.0, 20.0, 10.0
PNG = ROOT / "docs" / "protect.png"
BEGIN, END = "<!-- bench/protect.py: begin -->", "<!-- bench/protect.py: end -->"


def phases() -> list[tuple[float, list[Stream]]]:
    critical = Stream("critical", 0.2 * RATE, CRITICAL)
    return [(WARM, [critical]), (LOAD, [Stream("sheddable", 3 * RATE), critical]),
            (AFTER, [Stream("sheddable", 0.25 * RATE), critical])]


def measure(redis_url: str, workdir: Path, protect: str) -> Run:
    upstream = CapacityUpstream(CAPACITY, SERVICE)
    upstream.start()
    gateway = GatewayProcess(OVERLOAD.format(prefix=f"b{uuid.uuid4().hex[:8]}", upstream=upstream.url,
                                             protect=protect).replace("timeout: 30s", "timeout: 10s"),
                             workdir, redis_url=redis_url)
    gateway.start()
    try:
        return asyncio.run(offer(gateway.url + "/work", phases(), stats_url=upstream.url + "/stats", timeout=60))
    finally:
        gateway.stop()
        upstream.stop()


def series(result: Run) -> tuple[list[float], list[float], list[float]]:
    """Per second: its start, the 200 answers received in it, and the p90 of critical requests sent in it."""
    seconds = list(range(int(WARM + LOAD + AFTER)))
    good = [answered(result, t, t + 1) for t in seconds]
    p90 = [percentile([s.seconds for s in result.of("critical", t, t + 1) if s.status == 200], 90)
           for t in seconds]
    return [float(t) for t in seconds], good, p90


def row(name: str, result: Run) -> str:
    unloaded = percentile([s.seconds for s in result.of("critical", 0, WARM)], 50)
    critical = result.of("critical", WARM, WARM + LOAD)
    ok = [s.seconds for s in critical if s.status == 200]
    shed = result.of("sheddable", WARM, WARM + LOAD)
    refused = [s for s in shed if s.status == 503 and s.retry_after]
    after = [s for s in result.of("sheddable", WARM + LOAD) if s.status == 200]
    back = f"{after[0].at - WARM - LOAD:.1f} s" if after else "none in 10 s"
    return (f"| {name} | {answered(result, WARM + 2, WARM + LOAD) / RATE:.0%} | {len(ok) / len(critical):.0%} | "
            f"{percentile(ok, 90) / unloaded:.1f}x ({percentile(ok, 90) * 1000:.0f} ms) | "
            f"{len(refused) / len(shed):.0%} | {back} |")


def plot(results: dict[str, Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, result in results.items():
        seconds, good, p90 = series(result)
        top.plot(seconds, [g / RATE for g in good], label=name)
        bottom.plot(seconds, p90, label=name)
    for axis in (top, bottom):
        axis.axvspan(WARM, WARM + LOAD, color="0.9")
        axis.legend()
    top.set_ylabel("200s a second / capacity")
    bottom.set_ylabel("critical p90 (s)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds (grey: 3x the capacity of sheddable requests)")
    figure.tight_layout()
    figure.savefig(PNG, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", action="store_true", help="write docs/benchmarks.md's block and docs/protect.png")
    args = parser.parse_args()
    redis = RedisProcess()
    redis.start()
    results: dict[str, Run] = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for name, protect in (("protect", PROTECT), ("no protect", "")):
                workdir = Path(scratch) / name.replace(" ", "-")
                workdir.mkdir()
                results[name] = measure(redis.url, workdir, protect)
    finally:
        redis.stop()
    lines = ["| gateway | goodput: 200s a second / capacity (2-20 s of the overload) | critical answered 200 | "
             "critical p90 / unloaded | sheddable refused (503 + Retry-After) | first sheddable 200 after the "
             "overload |",
             "| --- | ---: | ---: | ---: | ---: | ---: |",
             *(row(name, result) for name, result in results.items()),
             "", "![goodput and critical p90 over time, with and without protect](protect.png)"]
    print("\n".join(lines))
    if args.docs:
        plot(results)
        run.write_doc_block(BEGIN, END, "Protecting the upstream: an overload with and without protect",
                            "python bench/protect.py --docs",
                            f"an upstream of {CAPACITY} x {SERVICE * 1000:.0f} ms, 3x its capacity of sheddable "
                            f"requests for {LOAD:.0f} s and 20% of critical ones", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
