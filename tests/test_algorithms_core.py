"""The seven algorithms against a real Redis whose clock the test sets (libfaketime): each one's
promise checked against a plain-Python model, with random arrivals and costs (hypothesis)."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.config import MAX_RULES, RedisSettings, Rule
from gateway.limiter import Decision, Limiter, RuleOutcome, rule_spec
from gateway.redis import make_runner
from tests.support.limiter_engine import Engine as MicrosecondEngine
from tests.support.redis_proc import RedisClock, RedisProcess

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

T0 = 1_800_000_000.0  # a fixed epoch second, aligned to every window used here
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Engine(MicrosecondEngine):
    """The model suite's engine, its Redis clock set in seconds."""

    def at(self, when: float) -> None:
        super().at(round(when * 1_000_000))


@pytest.fixture
def engine(clocked_redis: tuple[RedisProcess, RedisClock]) -> Iterator[Engine]:
    proc, clock = clocked_redis
    e = Engine(proc, clock)
    yield e
    e.close()


def key() -> str:
    return f"t:{{r}}:x:{uuid.uuid4().hex}"


# arrivals: (gap in ms since the previous request, cost)
arrivals = st.lists(st.tuples(st.integers(0, 700), st.integers(1, 3)), min_size=1, max_size=40)


def run(engine: Engine, rule: Rule, plan: list[tuple[int, int]]) -> list[tuple[float, int, Decision]]:
    """Times are returned in seconds since T0 (whole milliseconds as floats: compare with care)."""
    k, elapsed_ms, out = key(), 0, []
    for gap, cost in plan:
        elapsed_ms += gap
        engine.at(T0 + elapsed_ms / 1000)
        out.append((elapsed_ms / 1000, cost, engine.decide([rule], [k], [cost])))
    return out


@SETTINGS
@given(plan=arrivals, limit=st.integers(1, 6))
@example(plan=[(0, 1), (491, 1), (700, 1), (300, 1), (700, 1)], limit=1)  # leaves exactly one window later
def test_sliding_log_is_exact_in_every_window(engine: Engine, plan: list[tuple[int, int]], limit: int) -> None:
    window_ms = 1000  # compared in whole milliseconds: 2.191 - 1.0 > 1.191 in floats, not in time
    rule = Rule("r", (), "sliding_log", limit=limit, window=window_ms / 1000)
    admitted: list[tuple[int, int]] = []
    for now, cost, decision in run(engine, rule, plan):
        now_ms = round(now * 1000)
        in_window = sum(c for t, c in admitted if t > now_ms - window_ms)
        expected = cost <= limit and in_window + cost <= limit
        assert decision.admitted == expected
        if decision.admitted:
            admitted.append((now_ms, cost))
    for start, _ in admitted:
        assert sum(c for t, c in admitted if start <= t < start + window_ms) <= limit


@SETTINGS
@given(plan=arrivals, limit=st.integers(1, 6))
def test_fixed_window_counts_per_aligned_window(engine: Engine, plan: list[tuple[int, int]], limit: int) -> None:
    rule = Rule("r", (), "fixed_window", limit=limit, window=1.0)
    used: dict[int, int] = {}
    for now, cost, decision in run(engine, rule, plan):
        window = math.floor(now + 1e-9)
        expected = cost <= limit and used.get(window, 0) + cost <= limit
        assert decision.admitted == expected
        if expected:
            used[window] = used.get(window, 0) + cost
        elif cost <= limit:
            assert decision.retry_after_ms is not None
            assert abs(decision.retry_after_ms - (window + 1 - now) * 1000) <= 1


@SETTINGS
@given(plan=arrivals, burst=st.integers(1, 6), rate=st.sampled_from([1.0, 2.0, 5.0, 10.0]),
       algorithm=st.sampled_from(["token_bucket", "gcra"]))
def test_buckets_admit_at_most_burst_plus_rate_times_t(
    engine: Engine, plan: list[tuple[int, int]], burst: int, rate: float, algorithm: str
) -> None:
    rule = Rule("r", (), algorithm, rate=rate, burst=burst)
    tokens, last = float(burst), 0.0
    admitted: list[tuple[float, int]] = []
    for now, cost, decision in run(engine, rule, plan):
        tokens = min(burst, tokens + (now - last) * rate)
        last = now
        expected = cost <= burst and tokens + 1e-6 >= cost
        assert decision.admitted == expected, (now, cost, tokens)
        if expected:
            tokens -= cost
            admitted.append((now, cost))
    for i, (start, _) in enumerate(admitted):
        for end, _ in admitted[i:]:
            total = sum(c for t, c in admitted if start <= t <= end)
            assert total <= burst + rate * (end - start) + 1e-6


@SETTINGS
@given(plan=arrivals, limit=st.integers(2, 8))
def test_sliding_window_stays_under_the_weighted_estimate(
    engine: Engine, plan: list[tuple[int, int]], limit: int
) -> None:
    rule = Rule("r", (), "sliding_window", limit=limit, window=1.0)
    counts: dict[int, int] = {}
    for now, cost, decision in run(engine, rule, plan):
        window = math.floor(now + 1e-9)
        elapsed = now - window
        estimate = counts.get(window - 1, 0) * (1 - elapsed) + counts.get(window, 0)
        expected = cost <= limit and estimate + cost <= limit + 1e-9
        assert decision.admitted == expected
        if expected:
            counts[window] = counts.get(window, 0) + cost
        assert counts.get(window, 0) <= limit


@SETTINGS
@given(plan=st.lists(st.tuples(st.integers(0, 300), st.just(1)), min_size=1, max_size=40),
       burst=st.integers(1, 5))
def test_leaky_bucket_spaces_departures_and_bounds_the_queue(
    engine: Engine, plan: list[tuple[int, int]], burst: int
) -> None:
    rate = 5.0
    rule = Rule("r", (), "leaky_bucket", rate=rate, burst=burst)
    departures: list[float] = []
    for now, _, decision in run(engine, rule, plan):
        if decision.admitted:
            leave = now + decision.delay_ms / 1000
            if departures:
                assert leave - departures[-1] >= 1 / rate - 0.002
            departures.append(leave)
            waiting = sum(1 for d in departures if d > now + 1e-9)
            assert waiting <= burst
        else:
            assert decision.retry_after_ms is not None and decision.retry_after_ms > 0


@SETTINGS
@given(costs=st.lists(st.integers(1, 4), min_size=1, max_size=40), limit=st.integers(1, 20))
def test_quota_admits_exactly_its_total_and_never_refills(engine: Engine, costs: list[int], limit: int) -> None:
    rule = Rule("r", (), "quota", limit=limit)
    k, used = key(), 0
    for i, cost in enumerate(costs):
        engine.at(T0 + i * 3600)  # hours pass: nothing comes back
        decision = engine.decide([rule], [k], [cost])
        expected = used + cost <= limit
        assert decision.admitted == expected
        used += cost if expected else 0
        if not expected:
            assert decision.retry_after_ms is None
    assert engine.proc.client().pttl(k) in (-1, -2)  # stock has no TTL (or was never written)


def test_quota_with_a_period_refills_each_aligned_period(engine: Engine) -> None:
    rule = Rule("r", (), "quota", limit=2, window=60.0)
    k = key()
    engine.at(T0 + 10)
    assert [engine.decide([rule], [k], [1]).admitted for _ in range(3)] == [True, True, False]
    refused = engine.decide([rule], [k], [1])
    assert refused.retry_after_ms == 50_000
    engine.at(T0 + 60)
    assert engine.decide([rule], [k], [1]).admitted


def test_all_or_nothing_and_shadow(engine: Engine) -> None:
    roomy = Rule("roomy", (), "token_bucket", rate=1.0, burst=10)
    tight = Rule("tight", (), "quota", limit=1)
    shadow = Rule("watch", (), "fixed_window", limit=1, window=60.0, shadow=True)
    keys = [key(), key(), key()]
    engine.at(T0)
    assert engine.decide([roomy, tight, shadow], keys, [1, 1, 1]).admitted
    refused = engine.decide([roomy, tight, shadow], keys, [1, 1, 1])
    assert not refused.admitted and refused.refused_by == 1
    assert refused.rules[2].outcome is RuleOutcome.SHADOW_REFUSES
    # the refused request consumed nothing: roomy still has 9
    assert engine.decide([roomy], keys[:1], [0], peek=True).rules[0].remaining == 9
    only_shadow = engine.decide([roomy, shadow], [keys[0], keys[2]], [1, 1])
    assert only_shadow.admitted and only_shadow.rules[1].outcome is RuleOutcome.SHADOW_REFUSES


def test_a_cost_that_can_never_fit_has_no_retry(engine: Engine) -> None:
    engine.at(T0)
    for rule in (Rule("r", (), "gcra", rate=1.0, burst=3), Rule("r", (), "sliding_log", limit=3, window=1.0),
                 Rule("r", (), "fixed_window", limit=3, window=1.0)):
        decision = engine.decide([rule], [key()], [4])
        assert not decision.admitted and decision.retry_after_ms is None
        assert decision.rules[0].outcome is RuleOutcome.NEVER_FITS


@pytest.mark.parametrize("rule", [
    Rule("r", (), "fixed_window", limit=2, window=10.0),
    Rule("r", (), "sliding_window", limit=2, window=10.0),
    Rule("r", (), "sliding_log", limit=2, window=10.0),
    Rule("r", (), "token_bucket", rate=0.2, burst=2),
    Rule("r", (), "gcra", rate=0.2, burst=2),
    Rule("r", (), "leaky_bucket", rate=0.2, burst=1),
], ids=lambda r: r.algorithm)
def test_clock_step_backwards_admits_nothing_extra_and_never_wedges(engine: Engine, rule: Rule) -> None:
    k = key()
    engine.at(T0 + 5)
    while engine.decide([rule], [k], [1]).admitted:
        pass
    engine.at(T0 + 5 - 3600)  # an hour back
    assert not engine.decide([rule], [k], [1]).admitted
    # one window (or burst period) of the new time later, the key works again
    engine.at(T0 + 5 - 3600 + 21)
    assert engine.decide([rule], [k], [1]).admitted


def test_both_server_versions(any_redis: RedisProcess) -> None:
    limiter = Limiter(make_runner(RedisSettings(url=any_redis.url, timeout=2.0)))
    rules = [Rule("a", (), "gcra", rate=1.0, burst=2), Rule("b", (), "sliding_window", limit=5, window=1.0),
             Rule("c", (), "quota", limit=3)]
    keys = [key(), key(), key()]

    async def go() -> list[bool]:
        out = [(await limiter.decide([rule_spec(r) for r in rules], keys, [1, 1, 1])).admitted for _ in range(4)]
        await limiter.close()
        return out

    assert asyncio.run(go()) == [True, True, False, False]


def test_a_route_of_thirty_two_rules_is_one_script_and_names_the_refusing_rule(engine: Engine) -> None:
    kinds = [Rule("fw", (), "fixed_window", limit=5, window=10.0),
             Rule("sw", (), "sliding_window", limit=5, window=10.0),
             Rule("sl", (), "sliding_log", limit=5, window=10.0),
             Rule("tb", (), "token_bucket", rate=1.0, burst=5),
             Rule("gc", (), "gcra", rate=1.0, burst=5),
             Rule("lb", (), "leaky_bucket", rate=1.0, burst=5),
             Rule("qp", (), "quota", limit=5, window=3600.0),
             Rule("q", (), "quota", limit=5)]
    rules = [kinds[i % len(kinds)] for i in range(MAX_RULES - 1)] + [Rule("last", (), "quota", limit=1)]
    keys = [key() for _ in rules]
    engine.at(T0)
    first = engine.decide(rules, keys, [1] * MAX_RULES)
    assert first.admitted and [s.remaining for s in first.rules][:8] == [4, 4, 4, 4, 4, 5, 4, 4]
    assert first.rules[-1].remaining == 0  # (a leaky bucket also holds the one leaving)
    second = engine.decide(rules, keys, [1] * MAX_RULES)
    assert not second.admitted and second.refused_by == MAX_RULES - 1 and second.retry_after_ms is None


def test_numbers_too_large_to_pack_are_reported_exactly(engine: Engine) -> None:
    # a billion a year: remaining and reset in ms do not fit in one exact integer together
    big = Rule("big", (), "fixed_window", limit=10**9, window=366 * 86400.0)
    small = Rule("small", (), "token_bucket", rate=1.0, burst=3)
    keys = [key(), key()]
    engine.at(T0 + 1)
    decision = engine.decide([big, small], keys, [7, 1])
    window_ms = 366 * 86400 * 1000
    assert decision.rules[0].remaining == 10**9 - 7
    assert decision.rules[0].reset_ms == window_ms - (round((T0 + 1) * 1000) % window_ms)
    assert decision.rules[1].remaining == 2 and decision.rules[1].reset_ms == 1000


def test_a_rule_without_an_identity_sits_out_of_the_routes_script(engine: Engine) -> None:
    a = Rule("a", (), "token_bucket", rate=1.0, burst=5)
    b = Rule("b", (), "quota", limit=1)
    c = Rule("c", (), "quota", limit=1)
    keys = [key(), key(), key()]
    engine.at(T0)
    first = engine.decide([a, b, c], keys, [1, None, 1])
    assert first.admitted and [s.remaining for s in first.rules] == [4, 0]
    second = engine.decide([a, b, c], keys, [1, None, 1])
    assert not second.admitted and second.refused_by == 1  # c: the second of the rules taking part
    assert engine.client.exists(keys[1]) == 0
    assert engine.decide([a, b, c], keys, [1, 1, None]).admitted  # b takes part now, c sits out
    assert len(engine.limiter.scripts) == 1  # one script for the route, whoever sits out


@pytest.mark.parametrize("limit", [1000, 2**24], ids=["packed state", "string state"])
def test_thirty_two_sliding_windows_fit_in_one_script(engine: Engine, limit: int) -> None:
    rules = [Rule(f"w{i}", (), "sliding_window", limit=limit, window=10.0) for i in range(MAX_RULES)]
    keys = [key() for _ in rules]
    engine.at(T0)
    for expected in (limit - 3, limit - 6):
        decision = engine.decide(rules, keys, [3] * MAX_RULES)
        assert decision.admitted and {s.remaining for s in decision.rules} == {expected}


def test_a_fractional_count_written_by_someone_else_reports_whole_units(engine: Engine) -> None:
    rule = Rule("q", (), "quota", limit=5)
    k = key()
    engine.client.set(k, "2.5")
    engine.at(T0)
    decision = engine.decide([rule], [k], [1])  # counted as 3 used: never more than the limit
    assert decision.admitted and decision.rules[0].remaining == 1
    assert decision.rules[0].outcome is RuleOutcome.ADMITS
    assert engine.decide([rule], [k], [1]).admitted
    refused = engine.decide([rule], [k], [1])
    assert not refused.admitted and refused.rules[0].outcome is RuleOutcome.NEVER_FITS


# (19 characters led by a digit: a sliding window's layout, its digits read one by one for its own d)
GARBAGE = ["2.5", "-3", "abc", "nan", "inf", "1e3", "99999999999999999999", "",
           "8" + "z" * 18, "8" + " " * 18, "8" + "9" * 18, "7" + "/" * 18, "3" + "." * 18,
           "8000000000:80000000"]  # read as this window's counts at T0 (":" a digit of 10): INCRBY refuses it


@pytest.mark.parametrize("rule", [
    Rule("r", (), "fixed_window", limit=5, window=10.0),
    Rule("r", (), "sliding_window", limit=5, window=10.0),
    Rule("r", (), "sliding_log", limit=5, window=10.0),
    Rule("r", (), "token_bucket", rate=1.0, burst=5),
    Rule("r", (), "gcra", rate=1.0, burst=5),
    Rule("r", (), "leaky_bucket", rate=1.0, burst=5),
    Rule("r", (), "quota", limit=5, window=60.0),
    Rule("r", (), "quota", limit=5),
], ids=lambda r: f"{r.algorithm}{'/period' if r.algorithm == 'quota' and r.window else ''}")
def test_a_key_holding_something_else_never_breaks_a_decision(engine: Engine, rule: Rule) -> None:
    """Whatever an operator or another tool left under a key: an answer within the rule's bounds,
    never a script error (which would count against the Redis breaker shared by every route)."""
    engine.at(T0)
    for value in GARBAGE:
        k = key()
        engine.client.set(k, value)
        for _ in range(3):
            decision = engine.decide([rule], [k], [1])
            state = decision.rules[0]
            assert 0 <= state.remaining <= rule.capacity, (value, decision)
            assert -1 <= state.reset_ms <= 10_000 * 6, (value, decision)
            assert decision.admitted or decision.retry_after_ms is None or 0 <= decision.retry_after_ms <= 60_000
