"""Per-identity overrides in the decision script, against the models of tests/support/limiter_models.py
on a real redis-server whose clock the test moves (as tests/test_algorithms.py does).

A route of two rules; some identities have an override of one rule or both (other numbers of the
same algorithm, or unlimited: that rule sits out for them). Every decision of the one script call,
with the overridden numbers given as ARGV, is the model's of the rules as overridden for that
identity; the others keep the file's numbers, in the same script as ever.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Rule
from gateway.limiter import Decision, RuleSpec, rule_spec
from tests.support.limiter_engine import T0, Engine, clocked_server, fresh_keys, ms
from tests.support.limiter_models import NEVER, Route
from tests.support.redis_proc import binaries
from tests.test_algorithms import ALGORITHMS, period_us, rules

EXAMPLES = settings(max_examples=40, deadline=None)
IDENTITIES = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with clocked_server(binaries()["6.2"], tmp_path_factory.mktemp("clock")) as e:
        yield e


def overridden(rule: Rule, other: Rule) -> Rule:
    """`rule` (the file's) with the numbers of `other` (drawn for the same algorithm)."""
    return replace(rule, limit=other.limit, window=other.window, rate=other.rate, burst=other.burst)


def specs_for(file_rules: list[Rule], mine: list[Rule | None]) -> list[RuleSpec]:
    out = []
    for rule, override in zip(file_rules, mine, strict=True):
        spec = rule_spec(rule)
        out.append(spec if override is None or override is rule else rule_spec(override)._replace(base=spec))
    return out


def decide(engine: Engine, specs: list[RuleSpec], keys: list[str], costs: list[int | None]) -> Decision:
    return engine.loop.run_until_complete(engine.limiter.decide(specs, keys, costs))


@EXAMPLES
@given(data=st.data())
def test_overridden_identities_agree_with_the_model_of_their_numbers(engine: Engine, data: st.DataObject) -> None:
    algorithms = data.draw(st.lists(st.sampled_from(ALGORITHMS), min_size=2, max_size=2), label="algorithms")
    file_rules = [replace(data.draw(rules(a)), name=f"r{j}") for j, a in enumerate(algorithms)]
    # per identity and rule: the file's rule, an override of it, or None (unlimited)
    plans: list[list[Rule | None]] = []
    for _ in range(IDENTITIES):
        row: list[Rule | None] = []
        for rule in file_rules:
            kind = data.draw(st.sampled_from(["file", "override", "unlimited"]), label="override")
            if kind == "file":
                row.append(rule)
            elif kind == "override":
                row.append(overridden(rule, data.draw(rules(rule.algorithm), label="numbers")))
            else:
                row.append(None)
        plans.append(row)
    keys = [fresh_keys(2) for _ in range(IDENTITIES)]
    models = [Route([r for r in row if r is not None]) for row in plans]
    span = max(period_us(r) for r in file_rules)
    t = T0 + data.draw(st.integers(0, span), label="start")
    for n in range(data.draw(st.integers(1, 40), label="requests")):
        who = data.draw(st.integers(0, IDENTITIES - 1), label="identity")
        t += data.draw(st.one_of(st.just(0), st.integers(1, 2_000), st.integers(0, span // 3)), label="gap")
        row = plans[who]
        taking = [r for r in row if r is not None]
        if not taking:
            continue
        cost = data.draw(st.integers(1, min(r.capacity for r in taking) + 1), label="cost")
        costs: list[int | None] = [None if r is None else cost for r in row]
        engine.at(t)
        decision = decide(engine, specs_for(file_rules, row), keys[who], costs)
        answer = models[who].decide(t, [cost] * len(taking))
        where = f"request {n} of identity {who} at +{t - T0}us cost {cost}: {row}"
        assert decision.admitted == answer.admitted, where
        assert decision.refused_by == answer.refused_by, where
        retry = None if answer.retry_us is None or answer.retry_us == NEVER else ms(answer.retry_us)
        assert decision.retry_after_ms == retry, where
        assert decision.delay_ms == ms(answer.delay_us), where
        for state, expected in zip(decision.rules, answer.rules, strict=True):
            assert state.remaining == expected.remaining, where
            assert state.reset_ms == ms(expected.reset_us), where


def test_a_sliding_window_keeps_its_counts_when_an_override_comes_and_goes(engine: Engine) -> None:
    file_rule = Rule("r", (), "sliding_window", limit=3, window=2.0)
    bigger = replace(file_rule, limit=5)
    [key] = fresh_keys(1)
    plain = [rule_spec(file_rule)]
    raised = [rule_spec(bigger)._replace(base=rule_spec(file_rule))]
    engine.at(T0 + 10_000)
    assert [decide(engine, plain, [key], [1]).admitted for _ in range(4)] == [True, True, True, False]
    # the override reads the file's state: 3 taken of its 5
    assert [decide(engine, raised, [key], [1]).admitted for _ in range(3)] == [True, True, False]
    # and the file's script reads the override's: 5 taken, over its 3
    refused = decide(engine, plain, [key], [1])
    assert not refused.admitted and refused.rules[0].remaining == 0


def test_a_concurrency_rule_overridden_holds_its_own_number_of_slots_beside_a_lease(engine: Engine) -> None:
    file_rule = Rule("r", (), "concurrency", limit=1)
    bucket = Rule("b", (), "token_bucket", rate=1.0, burst=10)
    more = replace(file_rule, limit=3)
    keys = fresh_keys(2)
    specs = [rule_spec(more)._replace(base=rule_spec(file_rule)), rule_spec(bucket)]
    engine.at(T0 + 5_000)

    def take(n: int) -> Decision:
        return engine.loop.run_until_complete(engine.limiter.decide(specs, keys, [1, 1], lease=f"req{n}".encode()))

    taken = [take(n) for n in range(4)]
    assert [d.admitted for d in taken] == [True, True, True, False]
    assert taken[3].refused_by == 0 and taken[2].rules[1].remaining == 7   # the bucket's part, as ever
    held = engine.client.zrange(keys[0], 0, -1)
    assert sorted(held) == [b"req0:1", b"req1:1", b"req2:1"]               # leases named by the token
