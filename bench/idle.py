"""What a worker costs Redis at rest: the overrides' sync loop with 100 routes, one read of the change
signal a second (gateway/override_sync.py) against the poll of every route's versions a second it
replaced (`full_every=0` runs that poll on every sync). Counted, not timed: the script calls in
Redis's own commandstats (each a round trip; the commands a script runs inside are not counted).

    python bench/idle.py [--routes 100] [--seconds 10] [--docs]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: write_doc_block)

from gateway.config import RedisSettings, parse_config  # noqa: E402
from gateway.embedded import EmbeddedRedis  # noqa: E402
from gateway.limiter import Limiter  # noqa: E402
from gateway.override_sync import Overrides  # noqa: E402
from gateway.overrides import FULL_SYNC_INTERVAL, SYNC_INTERVAL  # noqa: E402
from gateway.redis import make_runner  # noqa: E402
from gateway.runtime import build_runtime  # noqa: E402

BEGIN, END = "<!-- bench/idle.py: begin -->", "<!-- bench/idle.py: end -->"


def _config(routes: int) -> str:
    lines = ["version: 1", f"redis: {{key_prefix: i{uuid.uuid4().hex[:8]}}}", "routes:"]
    for n in range(routes):
        lines += [f"  - name: r{n}", f"    match: {{path: /r{n}}}",
                  "    limits: [{name: ip, by: [ip], algorithm: gcra, rate: 10/s, burst: 10}]"]
    return "\n".join(lines) + "\n"


def _calls(redis: EmbeddedRedis) -> int:
    import redis as redis_py

    client = redis_py.Redis(unix_socket_path=redis.socket_path)
    stats = client.info("commandstats")
    client.close()
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


async def _measure(url: str, routes: int, seconds: float, full_every: float, redis: EmbeddedRedis) -> float:
    config = parse_config(_config(routes), "routes.yaml", {}, proxy=False)
    settings = RedisSettings(url=url, timeout=5.0, key_prefix=config.redis.key_prefix)
    runtime = build_runtime(config, settings, Limiter(make_runner(settings)))
    overrides = Overrides()
    await overrides.sync(runtime, full_every)  # the first, whole read
    before = _calls(redis)
    syncs = round(seconds / SYNC_INTERVAL)
    for _ in range(syncs):
        await overrides.sync(runtime, full_every)
    calls = _calls(redis) - before
    await runtime.limiter.close()
    return calls / syncs  # per sync: per worker-second at rest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routes", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--docs", action="store_true", help="write the result into docs/benchmarks.md")
    args = parser.parse_args()
    redis = EmbeddedRedis()
    redis.start()
    try:
        polled = asyncio.run(_measure(redis.url, args.routes, args.seconds, 0.0, redis))
        signalled = asyncio.run(_measure(redis.url, args.routes, args.seconds, FULL_SYNC_INTERVAL, redis))
    finally:
        redis.stop()
    polled -= 1  # the emulation reads the signal too, which the poll it replaced did not
    full = polled / FULL_SYNC_INTERVAL  # the poll every full period, averaged
    fleet = 8 * 10
    lines = [f"| a worker at rest, {args.routes} routes | Redis calls a second | 8 workers x 10 hosts |",
             "| --- | ---: | ---: |",
             f"| every route's versions polled each second (before) | {polled:.0f} | {polled * fleet:,.0f} |",
             f"| the change signal each second | {signalled:.0f} | {signalled * fleet:,.0f} |",
             f"| ... and every route's versions every {FULL_SYNC_INTERVAL:.0f} s | {signalled + full:.1f} "
             f"| {(signalled + full) * fleet:,.0f} |",
             "", f"A change still applies within {SYNC_INTERVAL:.0f} s of its write (the signal is read each "
             f"second); a write whose signal was lost (its writer died between the two) within "
             f"{FULL_SYNC_INTERVAL:.0f} s."]
    print("\n".join(lines))
    if args.docs:
        run.write_doc_block(BEGIN, END, "At rest: the overrides' change signal", "python bench/idle.py --docs",
                            f"{args.routes} routes, {args.seconds:.0f} syncs, Redis commandstats", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
