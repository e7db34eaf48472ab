"""The seven algorithms of lua/decide.lua, through gateway.limiter.Limiter, against real redis-server
processes (6.2 and 7) whose clock the test freezes and moves to the microsecond (libfaketime).

Every decision is held to a plain-Python model of the algorithm's promise (tests/support/
limiter_models.py): admitted or not, retry_after_ms, delay_ms, remaining, reset. After each random
history the promise itself is checked on what the engine admitted. Retries are probed: 1 ms before
retry_after_ms the same request is still refused, at retry_after_ms it is admitted.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Rule
from gateway.limiter import Decision, RuleOutcome, rule_spec
from tests.support.limiter_engine import T0, Engine, clocked_server, fresh_keys, ms
from tests.support.limiter_models import NEVER, Answer, Model, Route, model_for, step_us, window_us
from tests.support.redis_proc import binaries

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

EXAMPLES = settings(max_examples=30, deadline=None)
ALGORITHMS = ["fixed_window", "sliding_window", "sliding_log", "token_bucket", "gcra", "leaky_bucket", "quota"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # libfaketime works with the pip-shipped 6.2 server; Debian's jemalloc build hangs under it
    with clocked_server(binaries()["6.2"], tmp_path_factory.mktemp("clock")) as e:
        yield e


# --- rules, arrivals -------------------------------------------------------------------------------

WINDOWS = [0.05, 1.0, 2.5, 60.0]
RATES = [0.7, 1.0, 3.0, 7.0, 60.0, 1000.0, 3000.0]


NOT_SHADOW = st.just(False)


def rules(algorithm: str, shadow: st.SearchStrategy[bool] = NOT_SHADOW) -> st.SearchStrategy[Rule]:
    if algorithm in ("fixed_window", "sliding_window", "sliding_log"):
        return st.builds(lambda limit, window, s: Rule("r", (), algorithm, limit=limit, window=window, shadow=s),
                         st.integers(1, 8), st.sampled_from(WINDOWS), shadow)
    if algorithm == "quota":
        return st.builds(lambda limit, period, s: Rule("r", (), "quota", limit=limit, window=period, shadow=s),
                         st.integers(1, 12), st.sampled_from([0.0, 0.5, 3.0]), shadow)
    return st.builds(lambda burst, rate, s: Rule("r", (), algorithm, rate=rate, burst=burst, shadow=s),
                     st.integers(1, 6), st.sampled_from(RATES), shadow)


def period_us(rule: Rule) -> int:
    """The span over which the rule's state matters: its window, or its time to refill from empty."""
    if rule.algorithm in ("token_bucket", "gcra", "leaky_bucket"):
        return (rule.burst + 1) * step_us(rule)
    return window_us(rule) if rule.window else 10_000_000


def gaps(rule: Rule) -> st.SearchStrategy[int]:
    p = period_us(rule)
    return st.one_of(st.just(0), st.integers(1, 2_000), st.integers(0, max(1, p // 3)), st.integers(0, 3 * p))


def costs(rule: Rule) -> st.SearchStrategy[int]:
    cap = rule.capacity
    return st.one_of(st.integers(1, min(cap, 3)), st.integers(1, cap + 1))


# --- engine against model --------------------------------------------------------------------------

def same(decision: Decision, answer: Answer, where: str) -> None:
    """The engine's decision for one single-rule request is the model's, field by field."""
    state = decision.rules[0]
    assert decision.admitted == answer.admitted, where
    assert state.remaining == answer.remaining, where
    assert state.reset_ms == ms(answer.reset_us), where
    if answer.admitted:
        assert state.outcome is RuleOutcome.ADMITS, where
        assert decision.delay_ms == ms(answer.delay_us), where
        return
    assert decision.refused_by == 0, where
    if answer.retry_us == NEVER:
        assert state.outcome is RuleOutcome.NEVER_FITS and decision.retry_after_ms is None, where
    else:
        assert state.outcome is RuleOutcome.REFUSES and decision.retry_after_ms == ms(answer.retry_us), where


def ttl_bound_ms(rule: Rule) -> int:
    """The longest a key of this rule may live (ms): no key outlives the state it holds."""
    if rule.algorithm in ("token_bucket", "gcra", "leaky_bucket"):
        return ms((rule.burst + 1) * step_us(rule)) + 1
    if rule.algorithm == "sliding_window":
        return ms(2 * window_us(rule)) + 1
    return ms(window_us(rule)) + 1


def check_ttl(engine: Engine, rule: Rule, key: str) -> None:
    ttl = engine.client.pttl(key)
    if rule.algorithm == "quota" and not rule.window:
        assert ttl in (-1, -2)  # stock never expires, by design
    else:
        assert ttl != -1, "a key without a TTL"
        assert ttl <= ttl_bound_ms(rule), (ttl, rule)


def decide_and_compare(engine: Engine, model: Model, rule: Rule, key: str, t: int, cost: int) -> Answer:
    engine.at(t)
    answer = model.answer(t, cost)
    if not answer.admitted and answer.retry_us != NEVER:
        # the model's own retry is honest and tight: the promise admits at t + retry, not before
        assert model.admits(t + answer.retry_us, cost) and not model.admits(t + answer.retry_us - 1, cost)
    decision = engine.decide([rule], [key], [cost])
    same(decision, answer, f"{rule} at +{t - T0}us cost {cost}")
    if answer.admitted:
        model.take(t, cost)
    check_ttl(engine, rule, key)
    return answer


def check_promise(rule: Rule, admitted: list[tuple[int, int, int]]) -> None:
    """What the SPEC promises, checked on the engine's own admissions (time µs, cost, delay µs)."""
    if rule.algorithm in ("fixed_window", "quota"):
        size = window_us(rule) if rule.window else None
        per: Counter[int] = Counter()
        for t, c, _ in admitted:
            per[t // size if size else 0] += c
        assert all(v <= rule.limit for v in per.values())
    elif rule.algorithm == "sliding_log":
        units = sorted(t for t, c, _ in admitted for _ in range(c))
        size = window_us(rule)
        assert all(units[i + rule.limit] - units[i] >= size for i in range(len(units) - rule.limit))
    elif rule.algorithm == "sliding_window":
        size, per = window_us(rule), Counter[int]()
        for t, c, _ in admitted:
            wid, elapsed = divmod(t, size)
            assert Fraction(per[wid - 1] * (size - elapsed), size) + per[wid] + c <= rule.limit
            per[wid] += c
    elif rule.algorithm in ("token_bucket", "gcra"):
        for i, (start, _, _) in enumerate(admitted):
            for end, _, _ in admitted[i:]:
                total = sum(c for t, c, _ in admitted if start <= t <= end)
                assert total <= rule.burst + Fraction(rule.rate) * Fraction(end - start, 1_000_000)
    else:  # leaky_bucket: units leave one step apart; at most `burst` wait at any arrival
        step = step_us(rule)
        stays = [(t, t + d + j * step) for t, c, d in admitted for j in range(c)]  # (arrival, departure)
        leaving = sorted(d for _, d in stays)
        assert all(b - a >= step for a, b in itertools.pairwise(leaving))
        for t, _, _ in admitted:
            assert sum(1 for arrived, d in stays if arrived <= t < d) <= rule.burst


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@EXAMPLES
@given(data=st.data())
def test_each_algorithm_agrees_with_its_model_and_keeps_its_promise(
    engine: Engine, algorithm: str, data: st.DataObject
) -> None:
    rule = data.draw(rules(algorithm), label="rule")
    model = model_for(rule)
    [key] = fresh_keys(1)
    t = T0 + data.draw(st.integers(0, period_us(rule)), label="start")
    admitted: list[tuple[int, int, int]] = []
    for _ in range(data.draw(st.integers(1, 30), label="requests")):
        t += data.draw(gaps(rule))
        cost = data.draw(costs(rule))
        answer = decide_and_compare(engine, model, rule, key, t, cost)
        if answer.admitted:
            admitted.append((t, cost, answer.delay_us))
        elif answer.retry_us != NEVER and data.draw(st.booleans(), label="probe the retry"):
            # 1 ms short of retry_after_ms: still refused (and nothing taken); at it: admitted
            wait = ms(answer.retry_us) * 1000
            assert not decide_and_compare(engine, model, rule, key, t + wait - 1000, cost).admitted
            t += wait
            answer = decide_and_compare(engine, model, rule, key, t, cost)
            assert answer.admitted
            admitted.append((t, cost, answer.delay_us))
    check_promise(rule, admitted)


@pytest.mark.parametrize("rule", [
    Rule("r", (), "fixed_window", limit=3, window=2.0),
    Rule("r", (), "sliding_window", limit=3, window=2.0),
    Rule("r", (), "sliding_log", limit=3, window=2.0),
    Rule("r", (), "token_bucket", rate=3.0, burst=3),
    Rule("r", (), "gcra", rate=0.7, burst=3),
    Rule("r", (), "leaky_bucket", rate=3.0, burst=2),
    Rule("r", (), "quota", limit=3, window=7.0),
], ids=lambda r: r.algorithm)
def test_retry_after_is_honest_to_the_millisecond(engine: Engine, rule: Rule) -> None:
    [key] = fresh_keys(1)
    t = T0 + 250_123
    engine.at(t)
    decision = engine.decide([rule], [key], [1])
    while decision.admitted:
        t += 13_001
        engine.at(t)
        decision = engine.decide([rule], [key], [1])
    retry = decision.retry_after_ms
    assert retry is not None and retry > 1
    engine.at(t + (retry - 1) * 1000)
    assert not engine.decide([rule], [key], [1]).admitted
    engine.at(t + retry * 1000)
    assert engine.decide([rule], [key], [1], peek=True).rules[0].outcome is RuleOutcome.ADMITS
    assert engine.decide([rule], [key], [1]).admitted
    assert engine.client.pttl(key) > 0  # every key carries a TTL


def test_a_token_bucket_admits_its_whole_burst_at_once_whatever_the_rate(engine: Engine) -> None:
    """3/s is an interval of 333333.3 µs: rounding it each time used to lose the last token."""
    for rate in (3.0, 7.0, 60.0, 3000.0, 0.7):
        rule = Rule("r", (), "token_bucket", rate=rate, burst=5)
        [key] = fresh_keys(1)
        engine.at(T0 + 17)
        assert [engine.decide([rule], [key], [1]).admitted for _ in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cost_that_can_never_fit_gets_no_retry(engine: Engine, algorithm: str) -> None:
    rule = Rule("r", (), algorithm, limit=3, window=1.0, rate=1.0, burst=3)
    keys = fresh_keys(2)
    engine.at(T0 + 5_000)
    too_big = rule.capacity + 1
    decision = engine.decide([rule], keys[:1], [too_big])
    assert not decision.admitted and decision.retry_after_ms is None and decision.refused_by == 0
    assert decision.rules[0].outcome is RuleOutcome.NEVER_FITS
    # beside a rule that would only need a wait, the one that never fits is the one reported
    tight = Rule("t", (), "fixed_window", limit=1, window=60.0)
    engine.decide([tight], keys[1:], [1])
    both = engine.decide([tight, rule], [keys[1], keys[0]], [1, too_big])
    assert both.refused_by == 1 and both.retry_after_ms is None
    assert both.rules[0].outcome is RuleOutcome.REFUSES


def test_an_exhausted_quota_without_period_never_comes_back(engine: Engine) -> None:
    rule = Rule("r", (), "quota", limit=2)
    [key] = fresh_keys(1)
    engine.at(T0)
    assert [engine.decide([rule], [key], [1]).admitted for _ in range(3)] == [True, True, False]
    engine.at(T0 + 400 * 86_400 * 1_000_000)  # a year and more later
    decision = engine.decide([rule], [key], [1])
    assert not decision.admitted and decision.retry_after_ms is None
    assert decision.rules[0].outcome is RuleOutcome.NEVER_FITS and decision.rules[0].reset_ms == -1
    assert engine.client.pttl(key) == -1


def test_a_sliding_windows_key_expires_when_the_next_window_ends_however_it_was_written(engine: Engine) -> None:
    """The first write of a window sets the key's expiry to the end of the next window; the
    window's later writes keep it (KEEPTTL) and the next window's first write moves it on."""
    for limit in (10, 100_000, 2**24):  # the 19-digit value (two d's) and the string
        rule = Rule("r", (), "sliding_window", limit=limit, window=1.0)
        [key] = fresh_keys(1)
        for t in (T0 + 1_000, T0 + 400_017, T0 + 999_999, T0 + 1_000_005, T0 + 1_700_000, T0 + 3_200_000):
            engine.at(t)
            assert engine.decide([rule], [key], [1]).admitted
            next_window_ends = (t // 1_000_000 + 2) * 1_000_000
            assert engine.client.pttl(key) == next_window_ends // 1000 - 1 - t // 1000, (limit, t)


# --- routes: all or nothing, shadow ----------------------------------------------------------------

def raw_state(engine: Engine, keys: list[str]) -> list[tuple[bytes | None, int]]:
    pipe = engine.client.pipeline(transaction=False)
    for key in keys:
        pipe.dump(key)
        pipe.pttl(key)
    replies = pipe.execute()
    return list(zip(replies[::2], replies[1::2], strict=True))


@EXAMPLES
@given(data=st.data())
def test_a_route_is_all_or_nothing(engine: Engine, data: st.DataObject) -> None:
    """Random routes of 1-4 rules (some shadow): the decision is the models' combined; a refused
    request leaves every key byte for byte as it was; shadow rules never refuse and never delay."""
    algorithms = data.draw(st.lists(st.sampled_from(ALGORITHMS), min_size=1, max_size=4), label="algorithms")
    route = [data.draw(rules(a, shadow=st.booleans())) for a in algorithms]
    model = Route(route)
    keys = fresh_keys(len(route))
    t = T0 + data.draw(st.integers(0, 10_000_000))
    for _ in range(data.draw(st.integers(1, 25), label="requests")):
        t += data.draw(st.one_of(st.just(0), st.integers(1, 5_000), st.integers(0, 3_000_000)))
        costs_now = [data.draw(st.integers(1, min(r.capacity, 3))) for r in route]
        engine.at(t)
        before = raw_state(engine, keys)
        expected = model.decide(t, costs_now)
        decision = engine.decide(route, keys, costs_now)
        where = f"{route} at +{t - T0}us costs {costs_now}"
        assert decision.admitted == expected.admitted, where
        assert decision.refused_by == expected.refused_by, where
        assert decision.retry_after_ms == (None if expected.retry_us is None else ms(expected.retry_us)), where
        assert decision.delay_ms == ms(expected.delay_us), where
        for rule, state, answer in zip(route, decision.rules, expected.rules, strict=True):
            if answer.admitted:
                assert state.outcome is RuleOutcome.ADMITS, where
            elif rule.shadow:
                assert state.outcome is RuleOutcome.SHADOW_REFUSES, where
            else:
                assert state.outcome in (RuleOutcome.REFUSES, RuleOutcome.NEVER_FITS), where
        if not decision.admitted:
            assert raw_state(engine, keys) == before, where  # a refused request consumed nothing


def test_shadow_rules_count_but_never_refuse_or_delay(engine: Engine) -> None:
    watch = Rule("watch", (), "sliding_log", limit=2, window=60.0, shadow=True)
    shape = Rule("shape", (), "leaky_bucket", rate=1.0, burst=5, shadow=True)
    keys = fresh_keys(2)
    engine.at(T0)
    outcomes = []
    for _ in range(4):
        decision = engine.decide([watch, shape], keys, [1, 1])
        assert decision.admitted and decision.delay_ms == 0  # a shadow leaky bucket delays nothing
        outcomes.append(decision.rules[0].outcome)
    assert outcomes == [RuleOutcome.ADMITS, RuleOutcome.ADMITS, RuleOutcome.SHADOW_REFUSES, RuleOutcome.SHADOW_REFUSES]
    assert engine.client.zcard(keys[0]) == 2  # counted while it admitted, not after
    # enforced, the same leaky bucket does delay: its queue holds the four shadow admissions
    enforced = Rule("shape", (), "leaky_bucket", rate=1.0, burst=5)
    assert engine.decide([enforced], keys[1:], [1]).delay_ms == 4000


# --- the clock steps backwards ---------------------------------------------------------------------

def recovery_bound_us(rule: Rule) -> int:
    """How soon after a step back a full key must admit a request of cost 1 again: one window
    (sliding_window: as after any full window, one window and window/limit), one interval for
    a bucket."""
    if rule.algorithm in ("token_bucket", "gcra", "leaky_bucket"):
        return step_us(rule)
    if rule.algorithm == "sliding_window":
        return window_us(rule) + math.ceil(window_us(rule) / rule.limit)
    return window_us(rule)


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "quota"] + ["quota_period"])
@EXAMPLES
@given(data=st.data())
def test_a_clock_step_backwards_admits_nothing_extra_and_wedges_nothing(
    engine: Engine, algorithm: str, data: st.DataObject
) -> None:
    """After any history, step Redis's clock back by anything from 1 µs to several windows: the
    rule has no more room than before the step, and a full key admits again within one window
    (or bucket interval) of the new time, as its honest retry_after says."""
    if algorithm == "quota_period":
        rule = Rule("r", (), "quota", limit=data.draw(st.integers(1, 8)), window=data.draw(st.sampled_from([0.5, 3.0])))
    else:
        rule = data.draw(rules(algorithm), label="rule")
    model = model_for(rule)
    [key] = fresh_keys(1)
    t = T0 + data.draw(st.integers(0, period_us(rule)))
    for _ in range(data.draw(st.integers(0, 12), label="history")):
        t += data.draw(gaps(rule))
        decide_and_compare(engine, model, rule, key, t, data.draw(st.integers(1, rule.capacity)))
    engine.at(t)
    room_before = engine.decide([rule], [key], [0], peek=True).rules[0].remaining
    back = data.draw(st.one_of(st.integers(1, 5_000), st.integers(1, 5 * period_us(rule))), label="step back")
    t -= back
    engine.at(t)
    assert engine.decide([rule], [key], [0], peek=True).rules[0].remaining <= room_before
    taken = 0
    decision = engine.decide([rule], [key], [1])
    while decision.admitted:
        taken += 1
        decision = engine.decide([rule], [key], [1])
    assert taken <= room_before, "the step back admitted more than the key had left"
    again = engine.decide([rule], [key], [1])  # refusals repeat without pushing the wait out
    assert again.retry_after_ms == decision.retry_after_ms
    retry = decision.retry_after_ms
    assert retry is not None and retry * 1000 <= recovery_bound_us(rule) + 999, (retry, rule)
    engine.at(t + retry * 1000)
    assert engine.decide([rule], [key], [1]).admitted
    check_ttl(engine, rule, key)


# --- keys ------------------------------------------------------------------------------------------


def test_redis_time_follows_the_clock_to_the_microsecond(engine: Engine) -> None:
    for t in (T0 + 1, T0 + 999_999, T0 + 123_456_789):
        engine.at(t)
        assert engine.redis_time() == t


def test_model_sanity() -> None:
    """The models themselves: a burst at once, then the interval (3/s rounds up to 333334 µs)."""
    bucket = model_for(Rule("r", (), "token_bucket", rate=3.0, burst=2))
    assert step_us(bucket.rule) == 333_334
    first = bucket.answer(0, 1).admitted
    bucket.take(0, 1)
    assert [first, bucket.answer(0, 1).admitted] == [True, True]
    bucket.take(0, 1)
    assert bucket.answer(0, 1).retry_us == 333_334


# --- the script for rules of any kinds (the RLS port's) --------------------------------------------

ANY_KINDS = [a for a in ALGORITHMS if a != "leaky_bucket"]  # leaky_bucket delays: the RLS port refuses it
CALENDAR_DAY = Rule("r", (), "fixed_window", limit=3, window=86_400.0, calendar_period="day", calendar="Europe/Berlin")


def decide_any(engine: Engine, route: list[Rule], keys: list[str], costs_now: list[int | None],
               calendars: tuple[str, ...]) -> Decision:
    specs = [rule_spec(r) for r in route]
    return engine.loop.run_until_complete(engine.limiter.decide(specs, keys, costs_now, any_kinds=calendars))


@EXAMPLES
@given(data=st.data())
def test_the_script_for_any_kinds_decides_as_each_routes_own(engine: Engine, data: st.DataObject) -> None:
    """Random combinations of 1-6 rules of every kind the RLS port takes (shadow or not, a calendar
    day among them), random costs, some rules sitting out, time moving on and stepping back: the
    one script for any kinds answers field by field as the combination's own script, on keys of
    their own, and writes the keys it writes."""
    kinds = data.draw(st.lists(st.sampled_from([*ANY_KINDS, "calendar"]), min_size=1, max_size=6), label="kinds")
    route = [CALENDAR_DAY if k == "calendar" else data.draw(rules(k, shadow=st.booleans())) for k in kinds]
    own, generic = fresh_keys(len(route)), fresh_keys(len(route))
    calendars = ("day@Europe/Berlin",)
    t = T0 + data.draw(st.integers(0, 10_000_000))
    for _ in range(data.draw(st.integers(1, 25), label="requests")):
        t += data.draw(st.one_of(st.just(0), st.integers(1, 5_000), st.integers(0, 3_000_000),
                                 st.integers(-2_000_000, 0)))
        costs_now: list[int | None] = [data.draw(st.one_of(st.none(), st.integers(0, r.capacity + 1)))
                                       for r in route]
        engine.at(t)
        before = raw_state(engine, own), raw_state(engine, generic)
        expected = engine.decide(route, own, costs_now)
        decision = decide_any(engine, route, generic, costs_now, calendars)
        where = f"{route} at +{t - T0}us costs {costs_now}"
        assert decision == expected, where
        after = raw_state(engine, own), raw_state(engine, generic)
        # the same keys written (the states' bytes may differ: a sliding window's is another layout)
        assert [a != b for a, b in zip(before[0], after[0], strict=True)] == \
            [a != b for a, b in zip(before[1], after[1], strict=True)], where


def test_the_script_for_any_kinds_takes_thirty_two_rules(engine: Engine) -> None:
    """The most rules a call counts, of every kind at once, in one script call."""
    route = [Rule("r", (), a, limit=5, window=60.0) if a in ("fixed_window", "sliding_window", "sliding_log")
             else Rule("r", (), a, rate=1.0, burst=5) if a in ("token_bucket", "gcra")
             else Rule("r", (), "quota", limit=5) for a in itertools.islice(itertools.cycle(ANY_KINDS), 32)]
    keys = fresh_keys(32)
    engine.at(T0 + 5_000_000)
    decisions = [decide_any(engine, route, keys, [1] * 32, ()) for _ in range(6)]
    assert [d.admitted for d in decisions] == [True] * 5 + [False]
    assert [s.remaining for s in decisions[4].rules] == [0] * 32
