"""Redis-side cost of the decision engine: CPU per decision and memory per tracked identity.

    .venv/bin/python bench/engine.py            # both server versions when installed
    .venv/bin/python bench/engine.py --identities 20000 --decisions 20000
    .venv/bin/python bench/engine.py --instructions   # and instructions per decision (callgrind)

CPU: `INFO commandstats` usec_per_call of EVALSHA for a 3-rule route (token_bucket per user,
sliding_window per item, quota per item), the median of seven rounds of decisions over fresh and
existing keys, next to the floor under it: a script making the same Redis calls (TIME, MGET and
the three writes) and a reply of the same size with no logic, measured in turn with them.
Then per algorithm, on hot keys (a route of three rules of that algorithm over 50 identities,
every decision admitted): the decision's time over its floor's (the same rounds in turn), and
the Redis commands a decision makes (`INFO commandstats` calls besides EVALSHA, per decision;
the floor makes rules + 2).
redis-server runs pinned to one core and this process to the other. Memory: `used_memory` before
and after 100,000 identities each hit once, per O(1) algorithm, divided by the number of keys.
Results print as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import RedisSettings, Rule, Source
from gateway.keys import identity_token, state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess, binaries

O1_RULES = {
    "fixed_window": Rule("r", (Source("header", "x-user"),), "fixed_window", limit=100, window=86400.0),
    "sliding_window": Rule("r", (Source("header", "x-user"),), "sliding_window", limit=100, window=86400.0),
    "token_bucket": Rule("r", (Source("header", "x-user"),), "token_bucket", rate=0.01, burst=100),
    "gcra": Rule("r", (Source("header", "x-user"),), "gcra", rate=0.01, burst=100),
    "leaky_bucket": Rule("r", (Source("header", "x-user"),), "leaky_bucket", rate=0.01, burst=100),
    "quota": Rule("r", (Source("header", "x-user"),), "quota", limit=100, window=86400.0),
}
HOT = {  # every decision admitted, on keys whose state lives on: the buckets' time runs ahead (a
    # second per request), the windows are short (a decision often sees the last window's count)
    "fixed_window": Rule("r", (), "fixed_window", limit=10**9, window=0.1),
    "sliding_window": Rule("r", (), "sliding_window", limit=100_000, window=0.1),
    "token_bucket": Rule("r", (), "token_bucket", rate=1.0, burst=10**9),
    "gcra": Rule("r", (), "gcra", rate=1.0, burst=10**9),
    "leaky_bucket": Rule("r", (), "leaky_bucket", rate=1.0, burst=10**9),
    "quota": Rule("r", (), "quota", limit=10**12),
    "sliding_log": Rule("r", (), "sliding_log", limit=100_000, window=0.05),
}
# the routes measured on hot keys: three rules of each algorithm, and the route's three algorithms
HOT_ROUTES = {**{f"`{name}`": [HOT[name]] * 3 for name in HOT},
              "`token_bucket`, `sliding_window`, `quota`": [HOT["token_bucket"], HOT["sliding_window"], HOT["quota"]]}
ROUTE = [
    Rule("user", (Source("header", "x-user"),), "token_bucket", rate=100.0, burst=100),
    Rule("item", (Source("path", "item"),), "sliding_window", limit=1_000_000, window=1.0),
    Rule("stock", (Source("path", "item"),), "quota", limit=1_000_000_000),
]


def route_keys(i: int, users: int, route: str = "shop") -> list[str]:
    """The keys of decision number i: its user's bucket, its item's window and stock. The floor
    has keys of its own (route "floor"): its writes are not the decisions' state."""
    user = identity_token([f"user-{i % users}".encode()], False)
    item = identity_token([f"item-{i % 50}".encode()], True)
    return [state_key("rlgw", route, "user", user), state_key("rlgw", route, "item", item),
            state_key("rlgw", route, "stock", item)]


async def decisions(url: str, count: int, users: int) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    args = [rule_spec(r) for r in ROUTE]
    batch = 200
    for start in range(0, count, batch):
        calls = []
        for i in range(start, min(start + batch, count)):
            calls.append(limiter.decide(args, route_keys(i, users), [1, 1, 1]))
        await asyncio.gather(*calls)
    await limiter.close()


FLOOR = """
local t = redis.call('TIME')
local v = redis.call('MGET', unpack(KEYS))
local at = t[1] * 1000 + 60000
redis.call('SET', KEYS[1], t[2], 'PXAT', at)
redis.call('SET', KEYS[2], t[2], 'PXAT', at)
redis.call('INCRBY', KEYS[3], 1)
return {3, 4005, 4005, 4005}
"""


def floor_us(client: Any, count: int, users: int) -> float:
    """usec_per_call of FLOOR over the same keys as `decisions`."""
    sha = client.script_load(FLOOR)
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        pipe.evalsha(sha, 3, *route_keys(i, users, "floor"))
        if i % 200 == 199:
            pipe.execute()
    pipe.execute()
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def hot_keys(name: str, i: int, route: str = "hot") -> list[str]:
    return [state_key("rlgw", route, f"{name}-{n}", identity_token([f"id-{i % 50}".encode()], False))
            for n in range(3)]


def hot_floor(rules: list[Rule]) -> str:
    """TIME, one MGET, one write per rule (the algorithm's kind of write), a reply of the same size."""
    writes = ["redis.call('INCRBY', KEYS[{n}], 1)" if rule.algorithm == "quota" and not rule.window
              else "redis.call('SET', KEYS[{n}], t[2], 'PXAT', at)" for rule in rules]
    return "\n".join(["local t = redis.call('TIME')", "local v = redis.call('MGET', unpack(KEYS))",
                       "local at = t[1] * 1000 + 60000", *(w.format(n=n) for n, w in enumerate(writes, start=1)),
                       "return {3, 4005, 4005, 4005}"])


async def hot_decisions(url: str, name: str, count: int) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    specs = [rule_spec(rule) for rule in HOT_ROUTES[name]]
    for start in range(0, count, 200):
        calls = [limiter.decide(specs, hot_keys(name, i), [1, 1, 1])
                 for i in range(start, min(start + 200, count))]
        assert all(d.admitted for d in await asyncio.gather(*calls)), name
    await limiter.close()


def hot_floor_us(client: Any, name: str, count: int) -> float:
    sha = client.script_load(hot_floor(HOT_ROUTES[name]))
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        pipe.evalsha(sha, 3, *hot_keys(name, i, "floor"))
        if i % 200 == 199:
            pipe.execute()
    pipe.execute()
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def commands_per_call(client: Any) -> float:
    """Redis commands run inside the scripts since the last reset, per EVALSHA."""
    stats = client.info("commandstats")
    calls = stats["cmdstat_evalsha"]["calls"]
    connecting = ("cmdstat_evalsha", "cmdstat_config", "cmdstat_hello", "cmdstat_client", "cmdstat_info")
    inner = sum(v["calls"] for name, v in stats.items() if name.partition("|")[0] not in connecting)
    return float(inner / calls)


async def fill(url: str, rule: Rule, identities: int) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
    args = [rule_spec(rule)]
    batch = 500
    for start in range(0, identities, batch):
        calls = [limiter.decide(args, [state_key("rlgw", "api", rule.name, identity_token([f"u{i}".encode()], False))],
                                [1]) for i in range(start, min(start + batch, identities))]
        await asyncio.gather(*calls)
    await limiter.close()


ROUNDS = 7
CORES = sorted(os.sched_getaffinity(0))


def pin(proc: RedisProcess) -> None:
    """redis-server on the last core, this process on the others (when there are two or more)."""
    if len(CORES) >= 2 and proc.process is not None:
        os.sched_setaffinity(proc.process.pid, {CORES[-1]})
        os.sched_setaffinity(0, set(CORES[:-1]))


def measure(version: str, binary: str, decisions_n: int, identities: int) -> dict[str, float]:
    out: dict[str, float] = {}
    proc = RedisProcess(binary)
    proc.start()
    try:
        client = proc.client()
        asyncio.run(decisions(proc.url, 2000, 1000))  # load the script, warm up
        # Redis on one core, this process on the other; decision and floor rounds taken in turn so
        # that both see the same machine, and the median of seven (a shared host skews single runs)
        pin(proc)
        rounds, floors = [], []
        for _ in range(ROUNDS):
            client.config_resetstat()
            asyncio.run(decisions(proc.url, decisions_n // ROUNDS, 5000))
            rounds.append(float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
            floors.append(floor_us(client, decisions_n // ROUNDS, 5000))
        out["cpu_us_per_decision"] = statistics.median(rounds)
        out["floor_us"] = statistics.median(floors)
        for algorithm in HOT_ROUTES:
            asyncio.run(hot_decisions(proc.url, algorithm, 1000))  # the keys exist, the script is loaded
            ratios, commands = [], []
            for _ in range(ROUNDS):
                client.config_resetstat()
                asyncio.run(hot_decisions(proc.url, algorithm, decisions_n // ROUNDS // 4))
                commands.append(commands_per_call(client))
                decided = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
                ratios.append(decided / hot_floor_us(client, algorithm, decisions_n // ROUNDS // 4))
            out[f"floor_ratio:{algorithm}"] = statistics.median(ratios)
            out[f"commands:{algorithm}"] = statistics.median(commands)
        client.config_resetstat()
        asyncio.run(decisions(proc.url, decisions_n // ROUNDS, 5000))
        out["commands:route"] = commands_per_call(client)
        for name, rule in O1_RULES.items():
            client.flushall()
            before = client.info("memory")["used_memory"]
            asyncio.run(fill(proc.url, rule, identities))
            after = client.info("memory")["used_memory"]
            keys = client.dbsize()
            assert keys == identities, (name, keys)
            out[f"bytes_per_key:{name}"] = (after - before) / keys
    finally:
        proc.stop()
    return out


def instructions_per_call(binary: str, work: Callable[[str, int], None], inside: str | None = None) -> float:
    """Instructions redis-server executes per call of `work`, counted by callgrind: the difference
    between a run of 2,500 calls and one of 500 (start-up and shutdown cancel out). Unlike time,
    the count does not move with the host's load. `inside`: only those of this function and what it
    calls (callgrind_annotate --inclusive), e.g. evalShaCommand: the script's run, without reading
    and parsing the command and writing its reply."""
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (500, 2500):
            port = free_port()
            out = Path(tmp) / f"callgrind.{n}"
            proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary,
                                     "--port", str(port), "--save", "", "--appendonly", "no"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis(port=port)
            for _ in range(600):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
            work(f"redis://127.0.0.1:{port}", n)
            client.close()
            proc.terminate()
            proc.wait()
            if inside is None:
                found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
            else:
                text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                                      capture_output=True, text=True, check=True).stdout
                found = re.search(r"^\s*([\d,]+)\s.*\b" + inside + r"\b", text, re.MULTILINE)
            assert found, f"no callgrind count ({inside or 'totals'})"
            counts.append(int(found.group(1).replace(",", "")))
    return (counts[1] - counts[0]) / 2000


def count_instructions(binary: str) -> dict[str, float]:
    def decide(url: str, n: int) -> None:
        asyncio.run(decisions(url, n, 250))

    def floor(url: str, n: int) -> None:
        client = redis.Redis.from_url(url)
        floor_us(client, n, 250)
        client.close()

    route = "`token_bucket`, `sliding_window`, `quota`"

    def hot(url: str, n: int) -> None:
        asyncio.run(hot_decisions(url, route, n))

    def hot_floor_calls(url: str, n: int) -> None:
        client = redis.Redis.from_url(url)
        hot_floor_us(client, route, n)
        client.close()

    return {"decision": instructions_per_call(binary, decide), "floor": instructions_per_call(binary, floor),
            "hot": instructions_per_call(binary, hot, "evalShaCommand"),
            "hot_floor": instructions_per_call(binary, hot_floor_calls, "evalShaCommand")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=50_000)
    parser.add_argument("--identities", type=int, default=100_000)
    parser.add_argument("--instructions", action="store_true",
                        help="also count Redis's instructions per decision under callgrind (slow: a minute)")
    args = parser.parse_args()
    results = {version: measure(version, binary, args.decisions, args.identities)
               for version, binary in sorted(binaries().items())}
    versions = sorted(results)
    print(f"| measure | {' | '.join('Redis ' + v for v in versions)} | target |")
    print(f"| --- | {' | '.join('---:' for _ in versions)} | ---: |")
    row = " | ".join(f"{results[v]['cpu_us_per_decision']:.1f}" for v in versions)
    print(f"| Redis CPU per 3-rule decision, µs (EVALSHA usec_per_call) | {row} | <= 15 |")
    row = " | ".join(f"{results[v]['floor_us']:.1f}" for v in versions)
    print(f"| the same Redis calls without the logic (floor), µs | {row} | |")
    row = " | ".join(f"{results[v]['cpu_us_per_decision'] / results[v]['floor_us']:.2f}x" for v in versions)
    print(f"| the route's decision over its floor | {row} | <= 1.3x |")
    row = " | ".join(f"{results[v]['commands:route']:.2f}" for v in versions)
    print(f"| Redis commands per decision of the route (rules + 2 = 5) | {row} | <= 5 |")
    for name in O1_RULES:
        row = " | ".join(f"{results[v][f'bytes_per_key:{name}']:.0f}" for v in versions)
        print(f"| memory per identity, `{name}`, bytes | {row} | <= 130 |")
    if args.instructions and shutil.which("valgrind"):
        counted = {version: count_instructions(binary) for version, binary in sorted(binaries().items())}
        row = " | ".join(f"{counted[v]['decision'] / 1000:.1f}k" for v in versions)
        print(f"| redis-server instructions per 3-rule decision (callgrind) | {row} | |")
        row = " | ".join(f"{counted[v]['floor'] / 1000:.1f}k" for v in versions)
        print(f"| the same for the floor (callgrind) | {row} | |")
        row = " | ".join(f"{counted[v]['hot'] / 1000:.1f}k / {counted[v]['hot_floor'] / 1000:.1f}k = "
                         f"{counted[v]['hot'] / counted[v]['hot_floor']:.2f}x" for v in versions)
        print(f"| hot keys, the route's script over its floor, instructions inside EVALSHA (callgrind) | {row} "
              "| <= 1.3x |")
    print()
    print("Hot keys: a route of three rules of one algorithm, and one of the route's three algorithms "
          "(50 identities, every decision admitted):")
    print()
    print(f"| algorithm | {' | '.join(f'Redis {v}: over the floor, commands' for v in versions)} | target |")
    print(f"| --- | {' | '.join('---:' for _ in versions)} | ---: |")
    for algorithm in HOT_ROUTES:
        row = " | ".join(f"{results[v][f'floor_ratio:{algorithm}']:.2f}x, {results[v][f'commands:{algorithm}']:.2f}"
                         for v in versions)
        print(f"| {algorithm} | {row} | <= 1.3x, 5 |")


if __name__ == "__main__":
    main()
