"""What the script for rules of any kinds (the RLS port's) costs Redis per decision, beside a
route's own script and the per-combination script the RLS port ran before it.

    .venv/bin/python bench/any_kinds.py                 # instructions (callgrind) and time
    .venv/bin/python bench/any_kinds.py --no-instructions

Three ways to run the same rules on hot keys (every decision admitted): `own`, the route's script
with its numbers as constants (gateway.decision_script.write_script); `combination`, a script per
combination of kinds with the numbers in ARGV (what the RLS port loaded per call shape, without
bound); `any`, the one script for every combination (write_generic). Instructions inside EVALSHA
per decision, by callgrind (bench/engine.py's method: they do not move with the host's load), and
`INFO commandstats` usec_per_call, the median of seven alternating rounds (they do).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import instructions_per_call  # bench/engine.py

from gateway.config import RedisSettings, Rule
from gateway.decision_script import RuleSpec
from gateway.keys import identity_token, state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisProcess, binaries

HOT = {
    "fixed_window": Rule("r", (), "fixed_window", limit=10**9, window=60.0),
    "token_bucket": Rule("r", (), "token_bucket", rate=1.0, burst=10**9),
    "gcra": Rule("r", (), "gcra", rate=1.0, burst=10**9),
    "sliding_window": Rule("r", (), "sliding_window", limit=100_000, window=60.0),
    "quota": Rule("r", (), "quota", limit=10**12),
}
CALLS = {
    "1: fixed_window": ["fixed_window"],
    "3: token_bucket, sliding_window, quota": ["token_bucket", "sliding_window", "quota"],
    "8 of five kinds": ["fixed_window", "token_bucket", "sliding_window", "quota", "gcra", "fixed_window",
                        "sliding_window", "token_bucket"],
}
WAYS = ("own", "combination", "any")


def _combination(spec: RuleSpec) -> RuleSpec:
    """The spec as the RLS port sent it before: an override of its algorithm's canonical spec."""
    period = 0 if spec.algorithm == "quota" and spec.p2 == 0 else 1_000_000
    return spec._replace(base=RuleSpec(spec.algorithm, 1, period, spec.shadow, spec.charge, spec.force))


async def decisions(url: str, call: str, way: str, count: int) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    specs = [rule_spec(HOT[name]) for name in CALLS[call]]
    if way == "combination":
        specs = [_combination(spec) for spec in specs]
    any_kinds: tuple[str, ...] | None = () if way == "any" else None
    for start in range(0, count, 200):
        batch = []
        for i in range(start, min(start + 200, count)):
            keys = [state_key("rlgw", f"{way}-{call[0]}", str(n), identity_token([f"id-{i % 50}".encode()], False))
                    for n in range(len(specs))]
            batch.append(limiter.decide(specs, keys, [1] * len(specs), any_kinds=any_kinds))
        assert all(d.admitted for d in await asyncio.gather(*batch)), (call, way)
    await limiter.close()


def times(binary: str) -> dict[tuple[str, str], float]:
    proc = RedisProcess(binary)
    proc.start()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2 and proc.process is not None:  # Redis on one core, this process on the other
        os.sched_setaffinity(proc.process.pid, {cores[-1]})
        os.sched_setaffinity(0, set(cores[:-1]))
    client: Any = proc.client()
    out: dict[tuple[str, str], float] = {}
    try:
        for call in CALLS:
            rounds: dict[str, list[float]] = {way: [] for way in WAYS}
            for way in WAYS:
                asyncio.run(decisions(proc.url, call, way, 1000))
            for _ in range(7):
                for way in WAYS:
                    client.config_resetstat()
                    asyncio.run(decisions(proc.url, call, way, 4000))
                    rounds[way].append(float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
            out.update({(call, way): statistics.median(v) for way, v in rounds.items()})
    finally:
        proc.stop()
    return out


def instructions(binary: str) -> dict[tuple[str, str], float]:
    def work(call: str, way: str) -> Any:
        return lambda url, n: asyncio.run(decisions(url, call, way, n))

    return {(call, way): instructions_per_call(binary, work(call, way), "evalShaCommand")
            for call in CALLS for way in WAYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-instructions", action="store_true", help="skip callgrind (valgrind)")
    args = parser.parse_args()
    version = sorted(binaries())[0]
    binary = binaries()[version]
    counted = {} if args.no_instructions else instructions(binary)
    timed = times(binary)
    print(f"Redis {version}; per decision: instructions inside EVALSHA, usec_per_call (median of 7)\n")
    print("| rules | " + " | ".join(WAYS) + " | any / combination | any / own |")
    print("| --- |" + " --- |" * (len(WAYS) + 2))
    for call in CALLS:
        cells = [f"{counted[(call, way)]:,.0f}, {timed[(call, way)]:.1f} us" if counted
                 else f"{timed[(call, way)]:.1f} us" for way in WAYS]
        source = counted or timed
        ratios = [source[(call, "any")] / source[(call, "combination")], source[(call, "any")] / source[(call, "own")]]
        print(f"| {call} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
