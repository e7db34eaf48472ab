"""A worker's copy of the overrides (gateway.overrides.Overrides) kept in step with a real Redis:
only what changed is read while the changes are listed, the whole rule when more changed."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.config import RedisSettings, parse_config
from gateway.limiter import Limiter
from gateway.override_sync import Overrides
from gateway.overrides import CHANGES, PUT, Store, canonical
from gateway.redis import make_runner
from gateway.runtime import Runtime, build_runtime
from tests.support.redis_proc import RedisProcess

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {key_prefix: PREFIX}
routes:
  - name: api
    match: {path: /}
    limits:
      - {name: user, by: [header:X-User], algorithm: fixed_window, limit: 2, window: 1h}
"""
BODY = {"limit": 9, "window": "1m"}


def runtime_on(redis_proc: RedisProcess) -> Runtime:
    config = parse_config(CONFIG.replace("PREFIX", f"s{uuid.uuid4().hex[:8]}"), "routes.yaml", {}, proxy=False)
    settings = RedisSettings(url=redis_proc.url, timeout=5.0, key_prefix=config.redis.key_prefix)
    return build_runtime(config, settings, Limiter(make_runner(settings)))


def limits(runtime: Runtime) -> dict[str, int]:
    table = runtime.overrides.get("api", {}).get(0, {})
    return {token: found.rule.limit for token, found in table.items() if found.rule is not None}


def test_a_worker_reads_what_changed_and_the_whole_rule_past_the_changes_listed(redis_proc: RedisProcess) -> None:
    async def run() -> None:
        runtime = runtime_on(redis_proc)
        store = Store(runtime.limiter, runtime.redis.key_prefix)
        mine = Overrides()
        assert not await mine.sync(runtime) and limits(runtime) == {}
        await store.put("api", "user", "a", canonical(BODY), 100_000)
        assert await mine.sync(runtime) and limits(runtime) == {"a": 9}
        held = mine.stored[("api", "user")][0]
        await store.put("api", "user", "b", canonical({"limit": 3, "window": "1m"}), 100_000)
        await store.put("api", "user", "a", canonical({"limit": 4, "window": "1m"}), 100_000)
        await store.delete("api", "user", "b")
        assert await store.changes("api", "user", held) == (held + 3, {"a": canonical({"limit": 4, "window": "1m"}),
                                                                        "b": None})
        assert await mine.sync(runtime) and limits(runtime) == {"a": 4}      # three changes, read as such
        assert not await mine.sync(runtime)                                   # none since
        many = [f"u{n}" for n in range(CHANGES + 10)]
        await asyncio.gather(*(store.put("api", "user", token, canonical(BODY), 100_000) for token in many))
        assert await mine.sync(runtime)
        assert limits(runtime) == {"a": 4} | dict.fromkeys(many, 9)           # more than listed: read whole
        assert (await store.changes("api", "user", held))[1] is None
        await Overrides().sync(runtime)                                       # a worker starting now
        assert limits(runtime) == {"a": 4} | dict.fromkeys(many, 9)
        await runtime.limiter.close()

    asyncio.run(run())


def test_at_rest_a_worker_reads_only_the_change_signal_and_a_lost_signal_costs_one_full_period() -> None:
    """One deployment-wide counter, bumped by every write, instead of every route's versions each
    second; the versions are still polled every full period, so a write whose bump was lost (the
    writer died between the two) is applied within it."""
    redis_proc = RedisProcess()  # its own: nothing else calls it while the calls are counted

    async def run() -> None:
        runtime = runtime_on(redis_proc)
        store = Store(runtime.limiter, runtime.redis.key_prefix)
        mine = Overrides()
        assert not await mine.sync(runtime)
        before = _evalsha(redis_proc)
        for _ in range(10):
            assert not await mine.sync(runtime)
        assert _evalsha(redis_proc) - before == 10  # one call each: the signal
        await store.put("api", "user", "a", canonical(BODY), 100_000)
        assert await mine.sync(runtime) and limits(runtime) == {"a": 9}
        # a write whose signal was lost: stored, the counter not bumped
        await runtime.limiter.run_script(PUT, store._keys("api", "user"),
                                         ["b", canonical(BODY), 100_000, "user", CHANGES])
        assert not await mine.sync(runtime) and "b" not in limits(runtime)
        assert await mine.sync(runtime, full_every=0.0) and limits(runtime) == {"a": 9, "b": 9}
        await runtime.limiter.close()

    redis_proc.start()
    try:
        asyncio.run(run())
    finally:
        redis_proc.stop()


def _evalsha(redis_proc: RedisProcess) -> int:
    stats = redis_proc.client().info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
