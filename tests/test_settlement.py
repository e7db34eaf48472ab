"""Counting by the answer in the engine (lua/decide.lua's settling script, gateway/settlement.py):
a rule checked at admission and charged after the answer, and a rule that gives units back, against
the models of tests/support/limiter_models.py, on a real Redis whose clock the test moves."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Rule
from gateway.limiter import Decision, rule_spec
from tests.support.limiter_engine import T0, Engine, clocked_server, fresh_keys
from tests.support.limiter_models import model_for
from tests.support.redis_proc import binaries
from tests.test_algorithms import costs, gaps, period_us, rules, same

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

EXAMPLES = settings(max_examples=30, deadline=None)
CHARGED_AFTER = ["fixed_window", "sliding_window", "sliding_log", "quota", "token_bucket", "gcra"]
REFUNDED = ["fixed_window", "sliding_window", "quota", "token_bucket", "gcra"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with clocked_server(binaries()["6.2"], tmp_path_factory.mktemp("clock")) as e:
        yield e


def settle(engine: Engine, rule: Rule, key: str, amount: int) -> Decision:
    """The settling script for one rule: + charges, - refunds, whatever the room."""
    coro = engine.limiter.decide([rule_spec(rule).settling()], [key], [amount])
    return engine.loop.run_until_complete(coro)


@pytest.mark.parametrize("algorithm", CHARGED_AFTER)
@EXAMPLES
@given(data=st.data())
def test_a_rule_checked_at_admission_and_charged_after_the_answer(
        engine: Engine, algorithm: str, data: st.DataObject) -> None:
    rule = replace(data.draw(rules(algorithm), label="rule"), count_on=frozenset({401}))
    model = model_for(rule)
    [key] = fresh_keys(1)
    t = T0 + data.draw(st.integers(0, period_us(rule)), label="start")
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        t += data.draw(gaps(rule))
        engine.at(t)
        cost = data.draw(costs(rule))
        if data.draw(st.booleans(), label="an answer charges"):
            settle(engine, rule, key, cost)  # a 401 came back: charged, room or not
            model.charge(t, cost)
        else:
            answer = model.answer(t, cost)  # admission: the budget is checked, nothing is taken
            same(engine.decide([rule], [key], [cost]), answer, f"{rule} at +{t - T0}us cost {cost}")


@pytest.mark.parametrize("algorithm", REFUNDED)
@EXAMPLES
@given(data=st.data())
def test_a_refund_gives_back_what_admission_took(engine: Engine, algorithm: str, data: st.DataObject) -> None:
    rule = replace(data.draw(rules(algorithm), label="rule"), refund_on=frozenset(range(500, 600)))
    model = model_for(rule)
    [key] = fresh_keys(1)
    t = T0 + data.draw(st.integers(0, period_us(rule)), label="start")
    taken: list[int] = []  # admissions not yet refunded
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        t += data.draw(gaps(rule))
        engine.at(t)
        refunds = len(taken) > 0 and data.draw(st.booleans(), label="an answer refunds")
        if refunds:
            cost = taken.pop(data.draw(st.integers(0, len(taken) - 1)))
            settle(engine, rule, key, -cost)  # a 5xx came back: its units are given back
            model.give(t, cost)
            continue
        cost = data.draw(costs(rule))
        answer = model.answer(t, cost)
        same(engine.decide([rule], [key], [cost]), answer, f"{rule} at +{t - T0}us cost {cost}")
        if answer.admitted:
            model.take(t, cost)
            taken.append(cost)


def test_a_refund_that_never_was_charged_leaves_nothing_below_zero(engine: Engine) -> None:
    rule = Rule("r", (), "quota", limit=3, refund_on=frozenset({503}))
    [key] = fresh_keys(1)
    engine.at(T0)
    settle(engine, rule, key, -5)
    assert [engine.decide([rule], [key], [1]).admitted for _ in range(4)] == [True, True, True, False]
