"""What a decision asks of Redis: a request every rule admits makes TIME, one MGET and one write
per rule, nothing else (no TTL read), on every Redis version the suite runs; state written in the
earlier formats is still read as it was meant."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.config import RedisSettings, Rule
from gateway.keys import state_key
from gateway.limiter import Limiter, RuleSpec, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisProcess, binaries

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

RULES = {
    "fixed_window": Rule("r", (), "fixed_window", limit=1_000_000, window=1.0),
    "sliding_window": Rule("r", (), "sliding_window", limit=1_000_000, window=1.0),
    "sliding_window_small": Rule("r", (), "sliding_window", limit=100, window=0.5),
    "token_bucket": Rule("r", (), "token_bucket", rate=100_000.0, burst=100_000),
    "gcra": Rule("r", (), "gcra", rate=100_000.0, burst=100_000),
    "leaky_bucket": Rule("r", (), "leaky_bucket", rate=100_000.0, burst=100_000),
    "quota": Rule("r", (), "quota", limit=1_000_000_000),
    "quota_period": Rule("r", (), "quota", limit=1_000_000, window=60.0),
    # calendar periods (issue 30): the next local midnight is arithmetic in the script, no command
    "fixed_window_day": Rule("r", (), "fixed_window", limit=1_000_000, window=86_400.0, calendar_period="day",
                             calendar="Europe/Berlin"),
    "quota_month": Rule("r", (), "quota", limit=1_000_000, window=2_678_400.0, calendar_period="month",
                        calendar="America/New_York"),
}


def _calls(proc: RedisProcess) -> dict[str, int]:
    stats = proc.client().info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _decide(url: str, specs: list[RuleSpec], keys: list[str], times: int) -> list[bool]:
    async def main() -> list[bool]:
        limiter = Limiter(make_runner(RedisSettings(url=url, timeout=2.0)))
        out = [(await limiter.decide(specs, keys, [1] * len(keys))).admitted for _ in range(times)]
        await limiter.close()
        return out

    return asyncio.run(main())


def _made_by_decisions(proc: RedisProcess, specs: list[RuleSpec], keys: list[str], times: int) -> dict[str, int]:
    """The commands Redis ran for `times` decisions on keys that exist (connected, script loaded)."""
    async def main() -> dict[str, int]:
        limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=2.0)))
        for _ in range(2):
            assert (await limiter.decide(specs, keys, [1] * len(keys))).admitted
        # into the next window, with the last one's counts (a sliding window weighs them)
        await asyncio.sleep(max((s.p2 for s in specs if s.algorithm == "sliding_window"), default=0) / 1e6)
        before = _calls(proc)
        for _ in range(times):
            assert (await limiter.decide(specs, keys, [1] * len(keys))).admitted
        after = _calls(proc)
        await limiter.close()
        return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}

    return asyncio.run(main())


@pytest.mark.parametrize("names", [[name] for name in RULES] + [["token_bucket", "sliding_window", "quota"],
                                                                 ["gcra", "fixed_window_day", "quota_month"]],
                         ids=lambda names: "+".join(names))
def test_an_admitted_decision_makes_time_one_mget_and_one_write_per_rule(
    any_redis: RedisProcess, names: list[str]
) -> None:
    specs = [rule_spec(RULES[name]) for name in names]
    tag = uuid.uuid4().hex[:8]
    keys = [state_key("rlgw", tag, f"r{i}", "~") for i in range(len(specs))]
    made = _made_by_decisions(any_redis, specs, keys, 20)
    assert made.pop("evalsha") == 20
    for own in [name for name in made if name in ("info", "hello") or name.startswith("client")]:
        made.pop(own)  # the test's own connection's
    assert made.pop("time") == 20 and made.pop("mget") == 20
    assert sum(made.values()) == 20 * len(specs), made  # SET or INCRBY, once per rule


def test_a_bucket_written_in_the_earlier_redis_7_format_keeps_its_time() -> None:
    """Before, on Redis 7, a bucket's value held only the microseconds below the millisecond and
    its expiry the milliseconds. Such a key, left by a gateway before an upgrade, still means
    the same time: a bucket emptied that way stays empty."""
    proc = RedisProcess(binaries()["7"])  # the format was written on Redis 7 only
    proc.start()
    try:
        _emptied_in_the_earlier_format_stays_empty(proc)
    finally:
        proc.stop()


def _emptied_in_the_earlier_format_stays_empty(proc: RedisProcess) -> None:
    client = proc.client()
    rule = Rule("r", (), "token_bucket", rate=1.0, burst=5)
    key = state_key("rlgw", uuid.uuid4().hex[:8], "r", "~")
    seconds, micros = client.time()
    full_at_ms = seconds * 1000 + micros // 1000 + 5_000  # five requests taken: full again in 5 s
    client.set(key, "250", pxat=full_at_ms)
    assert _decide(proc.url, [rule_spec(rule)], [key], 1) == [False]


def test_a_sliding_window_keeps_its_counts_when_its_limit_changes(redis_proc: RedisProcess) -> None:
    """How a sliding window's value is laid out depends on its limit; a reload that changes the limit
    still reads the counts already taken."""
    key = state_key("rlgw", uuid.uuid4().hex[:8], "r", "~")
    small = rule_spec(Rule("r", (), "sliding_window", limit=100, window=86400.0))
    big = rule_spec(Rule("r", (), "sliding_window", limit=1_000_000, window=86400.0))

    async def main() -> tuple[int, int]:
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=2.0)))
        assert (await limiter.decide([small], [key], [30])).admitted
        raised = (await limiter.decide([big], [key], [0], peek=True)).rules[0].remaining
        assert (await limiter.decide([big], [key], [70])).admitted
        lowered = (await limiter.decide([small], [key], [0], peek=True)).rules[0].remaining
        await limiter.close()
        return raised, lowered

    assert asyncio.run(main()) == (1_000_000 - 30, 0)
