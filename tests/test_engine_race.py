"""Exact under concurrency, and one script call per decision, against a real Redis."""

from __future__ import annotations

import asyncio
import multiprocessing
import uuid
from pathlib import Path

from gateway.config import RedisSettings, Rule
from gateway.errors import RedisUnavailable
from gateway.keys import state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisClock, RedisProcess

QUOTA = Rule("stock", (), "quota", limit=100)
BUCKET = Rule("user", (), "token_bucket", rate=0.001, burst=50)


def _race(url: str, quota_key: str, bucket_key: str, tasks: int) -> tuple[int, int]:
    async def one(limiter: Limiter, rule: Rule, key: str) -> bool:
        return (await limiter.decide([rule_spec(rule)], [key], [1])).admitted

    async def main() -> tuple[int, int]:
        limiter = Limiter(make_runner(RedisSettings(url=url, timeout=5.0)))
        quota = await asyncio.gather(*[one(limiter, QUOTA, quota_key) for _ in range(tasks)])
        bucket = await asyncio.gather(*[one(limiter, BUCKET, bucket_key) for _ in range(tasks)])
        await limiter.close()
        return sum(quota), sum(bucket)

    return asyncio.run(main())


def test_processes_racing_a_quota_and_a_bucket_get_exactly_the_promise(tmp_path: Path) -> None:
    clock = RedisClock(tmp_path / "clock", start=1_800_000_000)  # frozen: the bucket cannot refill
    proc = RedisProcess(clock_file=clock.path)
    proc.start()
    try:
        context = multiprocessing.get_context("spawn")
        with context.Pool(4) as pool:
            for _ in range(3):
                quota_key, bucket_key = f"q:{uuid.uuid4().hex}", f"b:{uuid.uuid4().hex}"
                results = pool.starmap(_race, [(proc.url, quota_key, bucket_key, 60)] * 4)
                assert sum(q for q, _ in results) == 100  # 240 tried
                assert sum(b for _, b in results) == 50
    finally:
        proc.stop()


def _commandstats(proc: RedisProcess) -> dict[str, int]:
    stats = proc.client().info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_every_decision_is_one_script_call_and_survives_script_flush_and_restart() -> None:
    redis_proc = RedisProcess()  # its own: the commands counted are this test's alone (a shared server
    redis_proc.start()           # also hears other tests' processes and background polls)
    try:
        _one_script_call_each(redis_proc)
    finally:
        redis_proc.stop()


def _one_script_call_each(redis_proc: RedisProcess) -> None:
    rules = [Rule("user", (), "token_bucket", rate=100.0, burst=100),
             Rule("item", (), "sliding_window", limit=1000, window=1.0),
             Rule("stock", (), "quota", limit=10_000)]
    route = f"calls{uuid.uuid4().hex[:6]}"
    keys = [state_key("rlgw", route, r.name, "k") for r in rules]
    args = [rule_spec(r) for r in rules]

    async def decide(limiter: Limiter, n: int) -> int:
        errors = 0
        for _ in range(n):
            try:
                assert (await limiter.decide(args, keys, [1, 1, 1])).admitted
            except RedisUnavailable:
                errors += 1
        return errors

    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=2.0)))
        await decide(limiter, 1)  # connect and load the script
        redis_proc.client().config_resetstat()
        assert await decide(limiter, 25) == 0
        stats = _commandstats(redis_proc)
        assert stats.get("evalsha") == 25
        inside_the_script = {"time", "get", "mget", "set", "incrby", "pexpireat", "pexpire", "pttl",
                             "pexpiretime", "zadd", "zcard", "zrange", "zrangebyscore", "zremrangebyscore"}
        client_side = set(stats) - inside_the_script - {"info", "config", "hello", "client"}
        assert client_side == {"evalsha"}  # the gateway sent nothing but the 25 script calls
        redis_proc.client().script_flush()
        assert await decide(limiter, 5) == 0  # NOSCRIPT answered by SCRIPT LOAD, invisible to the caller
        await limiter.close()

    asyncio.run(main())


def test_a_restarted_redis_costs_at_most_the_call_in_flight() -> None:
    proc = RedisProcess()
    proc.start()
    try:
        async def main() -> int:
            limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=1.0)))
            rule = [rule_spec(Rule("g", (), "gcra", rate=1000.0, burst=1000))]
            await limiter.decide(rule, ["k"], [1])
            proc.restart()
            errors = 0
            for _ in range(5):
                try:
                    await limiter.decide(rule, ["k"], [1])
                except RedisUnavailable:
                    errors += 1
            await limiter.close()
            return errors

        assert asyncio.run(main()) <= 1
    finally:
        proc.stop()
