"""What counting by the answer and concurrency leases cost Redis: calls and script time per request,
a plain rule against a `count_on` rule (check at admission + charge after the answer), a `refund_on`
rule whose request is refunded (admission + refund), and a `concurrency` rule (admission + the
give-back, one lua/leases.lua call).

    .venv/bin/python bench/settlement.py [--requests 5000]

Each request is one identity's (fresh keys), through gateway.limiter.Limiter on a real redis-server;
calls and µs come from `INFO commandstats` (EVALSHA's calls and usec) before and after.
Results print as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import RedisSettings, Rule, Source
from gateway.leases import new_token
from gateway.limiter import Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisProcess, binaries

BY = (Source("header", "x-user"),)
CASES = {
    "plain fixed_window": (Rule("r", BY, "fixed_window", limit=5, window=900.0), None),
    "count_on [401]: check + charge": (
        Rule("r", BY, "fixed_window", limit=5, window=900.0, count_on=frozenset({401})), 1),
    "refund_on [5xx]: admission + refund": (
        Rule("r", BY, "fixed_window", limit=5, window=900.0, refund_on=frozenset(range(500, 600))), -1),
    "token_bucket refund_on: admission + refund": (
        Rule("r", BY, "token_bucket", rate=1.0, burst=5, refund_on=frozenset(range(500, 600))), -1),
    "concurrency: admission + give-back": (Rule("r", BY, "concurrency", limit=5), 0),
}


def evalsha(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def run(limiter: Limiter, rule: Rule, settle: int | None, requests: int, tag: str) -> None:
    spec = rule_spec(rule)
    for i in range(requests):
        key = f"b:{{{tag}}}:r:{i}"
        if rule.algorithm == "concurrency":
            token = new_token()
            await limiter.decide([spec], [key], [1], lease=token)
            await limiter.leases(True, [key], [token, 1, spec.p2])
            continue
        await limiter.decide([spec], [key], [1])
        if settle is not None:
            await limiter.decide([spec.settling()], [key], [settle])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    proc = RedisProcess(binaries()["6.2"])
    proc.start()
    client = proc.client()
    limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=2.0)))
    loop = asyncio.new_event_loop()
    print("| request | EVALSHA calls per request | script µs per request |")
    print("| --- | ---: | ---: |")
    try:
        for name, (rule, settle) in CASES.items():
            loop.run_until_complete(run(limiter, rule, settle, 200, f"warm-{name}"))
            calls, usec = evalsha(client)
            loop.run_until_complete(run(limiter, rule, settle, args.requests, name))
            after_calls, after_usec = evalsha(client)
            n = args.requests
            print(f"| {name} | {(after_calls - calls) / n:.2f} | {(after_usec - usec) / n:.2f} |")
    finally:
        loop.run_until_complete(limiter.close())
        loop.close()
        client.close()
        proc.stop()


if __name__ == "__main__":
    main()
