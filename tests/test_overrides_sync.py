"""A worker's copy of the overrides (gateway.overrides.Overrides) kept in step with a real Redis:
only what changed is read while the changes are listed, the whole rule when more changed."""

from __future__ import annotations

import asyncio
import uuid

from gateway.config import RedisSettings, parse_config
from gateway.limiter import Limiter
from gateway.override_sync import Overrides
from gateway.overrides import CHANGES, Store, canonical
from gateway.redis import make_runner
from gateway.runtime import Runtime, build_runtime
from tests.support.redis_proc import RedisProcess

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
