"""API keys at scale (gateway/api_keys.py): 1M registered keys. What each costs Redis and each worker,
how long a worker takes to read them all at start, what a change costs it, and what a lookup costs
a request. Counted and timed on this machine, one process.

    python bench/keys.py [--keys 1000000] [--docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: write_doc_block)

from gateway.api_keys import KeyStore, KeyTable, digest  # noqa: E402
from gateway.config import RedisSettings  # noqa: E402
from gateway.embedded import EmbeddedRedis  # noqa: E402
from gateway.limiter import Limiter  # noqa: E402
from gateway.redis import make_runner  # noqa: E402

BEGIN, END = "<!-- bench/keys.py: begin -->", "<!-- bench/keys.py: end -->"
CHUNK = 10_000


def _used_memory(redis: EmbeddedRedis) -> int:
    import redis as redis_py

    client = redis_py.Redis(unix_socket_path=redis.socket_path)
    used = int(client.info("memory")["used_memory"])
    client.close()
    return used


async def _measure(redis: EmbeddedRedis, count: int) -> dict[str, float]:
    settings = RedisSettings(url=redis.url, timeout=30.0, key_prefix=f"b{uuid.uuid4().hex[:6]}")
    limiter = Limiter(make_runner(settings))
    store = KeyStore(limiter, settings.key_prefix)
    plans = ("free", "pro", "enterprise")
    before = _used_memory(redis)
    started = time.perf_counter()
    for at in range(0, count, CHUNK):
        await store.write({digest(b"key-%d" % n): plans[n % 3] for n in range(at, min(at + CHUNK, count))})
    written = time.perf_counter() - started
    redis_bytes = (_used_memory(redis) - before) / count
    table = KeyTable()
    started = time.perf_counter()
    await store.follow(table)
    load = time.perf_counter() - started
    tracemalloc.start()  # a second read, traced (tracemalloc slows it several times: not the timed one)
    await store.follow(KeyTable())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = sum(a.buffer_info()[1] * a.itemsize for a in (table.digests, table.plan_of, table.consumer_of))
    assert len(table) == count
    keys = [b"key-%d" % n for n in range(0, count, max(1, count // 100_000))]
    started = time.perf_counter()
    for key in keys:
        table.lookup(key)
    lookup = (time.perf_counter() - started) / len(keys)
    started = time.perf_counter()
    await store.write({digest(b"new-key"): "pro"})
    changed = await store.follow(table)
    change = time.perf_counter() - started
    assert changed
    assert table.plan(b"new-key") == "pro"
    await limiter.close()
    return {"redis_bytes": redis_bytes, "worker_bytes": held / count, "peak_mb": peak / 2**20, "load_s": load,
            "write_s": written, "lookup_us": lookup * 1e6, "change_ms": change * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--docs", action="store_true", help="write the result into docs/benchmarks.md")
    args = parser.parse_args()
    redis = EmbeddedRedis()
    redis.start()
    try:
        r = asyncio.run(_measure(redis, args.keys))
    finally:
        redis.stop()
    n = f"{args.keys:,}"
    lines = ["| | measured |", "| --- | ---: |",
             f"| Redis memory per key ({n} keys, 3 plans) | {r['redis_bytes']:.0f} bytes |",
             f"| a worker's memory per key (sorted digests, plans and consumers) | {r['worker_bytes']:.0f} bytes |",
             f"| a worker reading them all at start (HSCAN, 10,000 a call) | {r['load_s']:.1f} s "
             f"(peak {r['peak_mb']:.0f} MiB while reading) |",
             f"| registering them (POST /keys's script, 10,000 a call) | {r['write_s']:.1f} s |",
             f"| one change, written and applied to a worker's table | {r['change_ms']:.1f} ms |",
             f"| a lookup, per request | {r['lookup_us']:.2f} µs |",
             "", "A change reaches every worker at its next read of the change signal, within a second.",
             f"(os.cpu_count() = {os.cpu_count()})"]
    print("\n".join(lines))
    if args.docs:
        run.write_doc_block(BEGIN, END, "API keys at scale", "python bench/keys.py --docs",
                            f"{n} keys, one process", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
