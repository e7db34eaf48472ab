"""`shards: N` without a cluster: the shard hash, the tags, the split arithmetic and the plans.

The cluster behaviour (spread over primaries, racing gateways, failover, resharding) is in
tests/test_cluster_shards.py.
"""

from __future__ import annotations

import textwrap
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import Rule, Source, keeps_full_limit, parse_config, shard_share
from gateway.decision_script import rule_spec
from gateway.keys import SLOTS, rule_key, shard_of, shard_tags, slot, state_key
from gateway.limiter import Decision
from gateway.plan import route_plan
from tests.support.limiter_engine import T0, Engine, clocked_server
from tests.support.redis_proc import binaries

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

USER = (Source("header", "x-user-id"),)
ITEM = (Source("path", "item"),)


def test_shard_of_is_fixed_bytes_not_pythons_hash() -> None:
    # the same numbers in every process, version and platform: a changed value reshuffles every
    # identity's shard on upgrade, so these are pinned
    assert [shard_of([b"alice"], 8), shard_of([b"bob"], 8)] == [5, 2]
    assert shard_of([b"alice", b"x"], 1024) == 767
    assert shard_of([b"", b"10.0.0.1"], 64) == 25
    assert shard_of([b"alice"], 1) == 0
    # parts are length-prefixed: moving a byte between parts changes the identity
    assert shard_of([b"ab", b"c"], 1 << 20) != shard_of([b"a", b"bc"], 1 << 20)


def test_identities_spread_evenly_over_shards() -> None:
    counts = Counter(shard_of([f"user-{i}".encode()], 16) for i in range(32_000))
    assert len(counts) == 16
    assert max(counts.values()) < 1.1 * 2000 and min(counts.values()) > 0.9 * 2000


def test_one_shard_keeps_todays_keys() -> None:
    assert shard_tags("seckill", 1) == ("seckill",)
    assert state_key("rlgw", "seckill", "user", "alice") == "rlgw:{seckill}:user:alice"
    assert state_key("rlgw", "seckill", "user", "alice", "seckill") == "rlgw:{seckill}:user:alice"


@pytest.mark.parametrize("shards", [2, 3, 6, 48, 1024])
def test_shard_tags_fall_in_evenly_spaced_slots(shards: int) -> None:
    tags = shard_tags("seckill", shards)
    assert len(set(tags)) == shards
    for shard, tag in enumerate(tags):
        assert tag.startswith(f"seckill:{shard}:")
        assert shard * SLOTS // shards <= slot(tag) < (shard + 1) * SLOTS // shards
    # so three primaries owning equal slot ranges (redis-cli --cluster create) get a third each
    if shards % 3 == 0:
        thirds = Counter(min(2, slot(tag) * 3 // SLOTS) for tag in tags)
        assert set(thirds.values()) == {shards // 3}


@given(st.integers(1, 10**9), st.integers(1, 1024))
def test_shares_add_up_to_the_limit_remainder_first(total: int, shards: int) -> None:
    shares = [shard_share(total, shards, s) for s in range(shards)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)  # the remainder goes to the first shards


def test_split_bucket_rates_never_add_up_to_more_than_the_rule() -> None:
    rule = Rule("global", (), "gcra", rate=2000.0, burst=200)
    for shards in (1, 3, 7, 64):
        specs = [rule_spec(rule, shards, s) for s in range(shards)]
        assert sum(spec.p1 for spec in specs) == 200
        assert sum(1_000_000 / spec.p2 for spec in specs) <= 2000.0 + 1e-9
    assert rule_spec(rule) == rule_spec(rule, 1, 0)


def test_which_rules_keep_their_full_limit() -> None:
    first = Rule("user", USER, "gcra", rate=5.0, burst=5)
    assert keeps_full_limit(first, Rule("user-min", USER, "sliding_window", limit=60, window=60.0))
    # refines the first identity: one user's dedupe keys are all in that user's shard
    dedupe = Rule("dedupe", (*USER, Source("body")), "sliding_log", limit=1, window=5.0)
    assert keeps_full_limit(first, dedupe)
    # ... unless it falls back to the address while the first rule's identity is there
    assert not keeps_full_limit(first, replace(dedupe, on_missing="ip"))
    assert keeps_full_limit(replace(first, on_missing="ip"), replace(first, name="same", on_missing="ip"))
    assert not keeps_full_limit(first, Rule("item", ITEM, "quota", limit=100))
    assert not keeps_full_limit(first, Rule("global", (), "gcra", rate=2000.0, burst=200))


SALE = """\
version: 1
upstreams: {{shop: {{url: "http://127.0.0.1:9000"}}}}
routes:
  - name: sale
    match: {{path: "/sale/{{item}}"}}
    upstream: shop
    shards: {shards}
    limits:
      - {{name: user,   by: [header:X-User-Id], algorithm: token_bucket, rate: 5/s, burst: 5}}
      - {{name: item,   by: [path:item], algorithm: sliding_window, limit: 1000, window: 1s}}
      - {{name: stock,  by: [path:item], algorithm: quota, limit: 100}}
      - {{name: dedupe, by: [header:X-User-Id, body], algorithm: sliding_log, limit: 1, window: 5s}}
      - {{name: global, by: [], algorithm: gcra, rate: 2000/s, burst: 200}}
"""


def test_a_sharded_plan_splits_only_the_other_identities() -> None:
    config = parse_config(textwrap.dedent(SALE.format(shards=8)), "routes.yaml", {})
    route = config.routes[0]
    assert route.shards == 8
    assert route.split == (False, True, True, False, True)
    plan = route_plan(route, "rlgw", None)
    assert len(plan.shard_args) == len(plan.shard_prefix_keys) == 8
    limits = [[specs[i].p1 for specs in plan.shard_args] for i in range(5)]
    assert limits[0] == [5] * 8                       # user: full burst everywhere
    assert limits[1] == [125] * 8                     # item: 1000 / 8
    assert limits[2] == [13] * 4 + [12] * 4           # stock: 100 = 4 * 13 + 4 * 12
    assert limits[3] == [1] * 8                       # dedupe: refines user, full limit
    assert limits[4] == [25] * 8                      # global: burst 200 / 8 ...
    assert {specs[4].p2 for specs in plan.shard_args} == {4000}  # ... at 250/s each
    assert sum(limits[2]) == 100
    for shard, prefixes in enumerate(plan.shard_prefix_keys):
        assert prefixes[2] == f"rlgw:{{{shard_tags('sale', 8)[shard]}}}:stock:"
    # at most one script per distinct share: 2 here
    assert len(set(plan.shard_args)) == 2


def test_one_shard_plan_is_the_plan_of_before() -> None:
    config = parse_config(textwrap.dedent(SALE.format(shards=1)), "routes.yaml", {})
    plan = route_plan(config.routes[0], "rlgw", None)
    assert plan.prefix_keys[2] == "rlgw:{sale}:stock:"
    assert plan.args == tuple(rule_spec(rule) for rule in config.routes[0].limits)
    assert plan.shard_args == (plan.args,)


SPLIT = """
version: 1
routes:
  - name: split
    match: {path: "/split/{item}"}
    shards: 4
    limits:
      - {name: user, by: [header:X-User-Id], algorithm: token_bucket, rate: 100/s, burst: 100}
      - {name: global, by: [], algorithm: gcra, rate: 8/s, burst: 8}
      - {name: item, by: ["path:item"], algorithm: fixed_window, limit: 12, window: 10s}
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with clocked_server(binaries()["6.2"], tmp_path_factory.mktemp("clock")) as e:
        yield e


@pytest.mark.parametrize("refusing", ["global", "item"])
def test_retry_after_is_honest_in_each_shard(engine: Engine, refusing: str) -> None:
    """A split rule refuses from the request's own shard, and its retry_after_ms is that shard's:
    the same request alone is refused 1 ms before it and admitted at it (Redis's clock moved)."""
    text = SPLIT if refusing == "global" else SPLIT.replace("rate: 8/s, burst: 8", "rate: 800/s, burst: 800")
    plan = route_plan(parse_config(textwrap.dedent(text), "routes.yaml", {}, proxy=False).routes[0],
                      f"h{uuid.uuid4().hex[:6]}", None)
    users: dict[int, bytes] = {}
    n = 0
    while len(users) < plan.shards:
        name = f"user-{n}".encode()
        users.setdefault(shard_of([name], plan.shards), name)
        n += 1
    t = T0 + 7_000_000_000

    def decide(user: bytes, at: int) -> Decision:
        engine.at(at)
        shard = plan.shard_of([user])
        prefixes = plan.shard_prefix_keys[shard]
        keys = [rule_key(prefixes[0], [user], plan.readable[0]), rule_key(prefixes[1], [], plan.readable[1]),
                rule_key(prefixes[2], [b"9"], plan.readable[2])]
        return engine.loop.run_until_complete(engine.limiter.decide(plan.shard_args[shard], keys, [1, 1, 1]))

    for shard, user in sorted(users.items()):
        admitted = 0
        while (first := decide(user, t)).admitted:
            admitted += 1
        assert admitted == (2 if refusing == "global" else 3), "each shard holds a quarter of the rule"
        assert plan.route.limits[first.refused_by or 0].name == refusing and first.retry_after_ms
        retry_us = first.retry_after_ms * 1000
        assert not decide(user, t + retry_us - 1000).admitted, f"shard {shard}: admitted before its retry"
        assert decide(user, t + retry_us).admitted, f"shard {shard}: refused at its retry"
        t += 20_000_000  # the next shard starts after every window of this one
