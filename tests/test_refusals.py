"""Refusals from memory (gateway/refusals.py, issue 13), against real Redis and real gateways.

1. A property: the same requests at the same moments get the same answers through the cache
   (LocalRefusals.decide, as gateway/pipeline.py calls it) as the models (tests/support/
   limiter_models.py) give without it, for every algorithm, alone and in routes of several rules;
   an answer from memory is the model's refusal (its rule, remaining, and a retry and reset that
   count down, at most 1 ms above the model's).
2. End to end: a request a held refusal covers never reaches Redis (its MONITOR feed); an admin
   reset makes the next request admitted at once; and where memory must not answer (a cheaper
   request, a cost from a header, a leaky_bucket, a rule sitting out, a shadow rule, a quota without
   period, a reload) the request goes to Redis.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Rule
from gateway.limiter import Decision, RuleOutcome, RuleState, rule_spec
from gateway.refusals import LocalRefusals
from tests.support.gateway_proc import GatewayProcess
from tests.support.limiter_engine import T0, Engine, clocked_server, fresh_keys, ms
from tests.support.limiter_models import Route
from tests.support.raw_http import Conn
from tests.support.redis_proc import RedisProcess, binaries
from tests.support.script_feed import decisions
from tests.support.upstream import Upstream
from tests.test_algorithms import ALGORITHMS, period_us, rules

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

EXAMPLES = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with clocked_server(binaries()["6.2"], tmp_path_factory.mktemp("clock")) as e:
        yield e


class Clock:
    """The cache's clock, moved with Redis's (µs): only differences matter to the cache."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def run_with_cache(engine: Engine, route: list[Rule], data: st.DataObject, start: int) -> tuple[int, int]:
    """Drive `route` with drawn requests; every answer, from memory or from Redis, is the models'.
    Returns how many were answered from memory, and how many of those had a retry (not never-fits)."""
    model = Route(route)
    keys = fresh_keys(len(route))
    clock = Clock()
    # held for as long as Redis would refuse, or capped (local_refusals.max_hold): exact either way
    cache = LocalRefusals(64, max_hold=data.draw(st.sampled_from([0.05, 1.0, 10.0**6]), label="max hold"),
                          clock=clock)
    period = max(period_us(r) for r in route)
    t, hits, timed = start, 0, 0
    costs_now = [1] * len(route)
    specs = [rule_spec(r) for r in route]
    for _ in range(data.draw(st.integers(1, 40), label="requests")):
        t += data.draw(st.one_of(st.just(0), st.integers(1, 3_000), st.integers(0, max(1, period // 4)),
                                 st.integers(0, 2 * period)), label="gap")
        if data.draw(st.integers(0, 3), label="new costs") == 0:  # mostly the same request again
            costs_now = [data.draw(st.one_of(st.integers(1, min(r.capacity, 3)), st.just(r.capacity + 1)))
                         for r in route]
        engine.at(t)
        clock.now = t
        expected = model.decide(t, costs_now)
        where = f"{route} at +{t - T0}us costs {costs_now}"
        ask = partial(engine.limiter.decide, specs, keys, costs_now)
        decision, from_memory = engine.loop.run_until_complete(cache.decide(route, keys, costs_now, ask))
        assert decision.admitted == expected.admitted, where
        assert decision.refused_by == expected.refused_by, where
        if not from_memory:
            assert decision.retry_after_ms == (None if expected.retry_us is None else ms(expected.retry_us)), where
            continue
        hits += 1
        assert decision.refused_by is not None
        answer = expected.rules[decision.refused_by]
        state = decision.rules[decision.refused_by]
        if expected.retry_us is None:
            # never fits: refused whatever the state; its rate-limit fields are as when Redis refused
            assert decision.retry_after_ms is None, where
        else:
            timed += 1
            assert state.remaining == answer.remaining, where
            assert decision.retry_after_ms is not None, where
            assert 0 <= decision.retry_after_ms - ms(expected.retry_us) <= 1, where
            assert 0 <= state.reset_ms - ms(answer.reset_us) <= 1, where
    return hits, timed


HITS: dict[str, tuple[int, int]] = {}


def count(name: str, hits: tuple[int, int]) -> None:
    before = HITS.get(name, (0, 0))
    HITS[name] = (before[0] + hits[0], before[1] + hits[1])


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "quota_period"])
@EXAMPLES
@given(data=st.data())
def test_answers_from_memory_are_the_models_for_each_algorithm(
    engine: Engine, algorithm: str, data: st.DataObject
) -> None:
    if algorithm == "quota_period":
        rule = Rule("r", (), "quota", limit=data.draw(st.integers(1, 8)), window=data.draw(st.sampled_from([0.5, 3.0])))
    else:
        rule = data.draw(rules(algorithm), label="rule")
    start = T0 + data.draw(st.integers(0, period_us(rule)), label="start")
    count(algorithm, run_with_cache(engine, [rule], data, start))


@EXAMPLES
@given(data=st.data())
def test_answers_from_memory_are_the_models_for_routes_of_several_rules(engine: Engine, data: st.DataObject) -> None:
    algorithms = data.draw(st.lists(st.sampled_from(ALGORITHMS), min_size=2, max_size=3), label="algorithms")
    route = [data.draw(rules(a, shadow=st.sampled_from([False, False, False, True]))) for a in algorithms]
    route = [Rule(f"r{i}", r.by, r.algorithm, r.limit, r.window, r.rate, r.burst, shadow=r.shadow)
             for i, r in enumerate(route)]
    count("route", run_with_cache(engine, route, data, T0 + data.draw(st.integers(0, 10**7))))


def test_the_properties_did_answer_from_memory() -> None:
    """The property runs above answered from memory for every algorithm that keeps refusals (so
    they tested the cache, not only Redis); leaky_bucket only for costs that never fit, by design."""
    if not HITS:
        pytest.skip("counts what the property tests above did: run it with them")
    assert set(HITS) == {*ALGORITHMS, "quota_period", "route"}, HITS
    kept = [a for a in HITS if a != "leaky_bucket"]
    # every algorithm answered from memory; refusals with a retry (timed) among them overall: which
    # algorithm draws only costs that never fit in one run is chance (a clean run once drew none timed)
    assert all(HITS[a][0] > 0 for a in kept), HITS
    assert sum(HITS[a][1] for a in kept) > 0, HITS
    assert HITS.get("leaky_bucket", (0, 0))[1] == 0, HITS


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    evalsha, eval_ = stats.get("cmdstat_evalsha", {}), stats.get("cmdstat_eval", {})
    return int(evalsha.get("calls", 0)) - int(evalsha.get("failed_calls", 0)) + int(eval_.get("calls", 0))


def test_when_a_refusal_runs_out_one_request_asks_for_all_that_arrive_together(engine: Engine) -> None:
    """A flood does not turn into a burst of Redis calls each time a held refusal runs out: of 20
    requests arriving together, one asks (admitted: the bucket gave one back), the next asks
    (refused again, and held), and the other 18 are answered from memory. All as Redis would."""
    rule = Rule("r", (), "token_bucket", rate=10.0, burst=1)
    keys = fresh_keys(1)
    clock = Clock()
    cache = LocalRefusals(10, clock=clock)
    specs = [rule_spec(rule)]

    async def one() -> tuple[Decision, bool]:
        return await cache.decide([rule], keys, [1], partial(engine.limiter.decide, specs, keys, [1]))

    async def together(n: int) -> list[tuple[Decision, bool]]:
        return list(await asyncio.gather(*(one() for _ in range(n))))

    engine.at(T0)
    clock.now = T0
    first = engine.loop.run_until_complete(together(2))
    assert [d.admitted for d, _ in first] == [True, False]
    engine.at(T0 + 100_000)  # the token is back: the refusal ran out
    clock.now = T0 + 100_000
    before = script_calls(engine.client)
    flood = engine.loop.run_until_complete(together(20))
    assert script_calls(engine.client) - before == 2
    assert [d.admitted for d, _ in flood] == [True] + [False] * 19
    assert sum(1 for _, local in flood if local) == 18
    assert all(d.retry_after_ms == 100 for d, _ in flood[1:])


# --- the cache alone: bounds, reset, what it keeps --------------------------------------------------


def refusal(by: int, retry: int | None, remaining: int, reset: int,
            outcome: RuleOutcome = RuleOutcome.REFUSES) -> Decision:
    return Decision(False, by, retry, 0, (RuleState(outcome, remaining, reset),))


def test_bounded_least_recently_used_first_and_reset_by_key() -> None:
    clock = Clock()
    rule = Rule("r", (), "fixed_window", limit=1, window=60.0)
    cache = LocalRefusals(3, clock=clock)
    for name in ("a", "b", "c"):
        assert cache.remember([rule], [name], [1], refusal(0, 30_000, 0, 30_000), sent=clock.now)
    assert cache.answer(["a"], [1]) is not None  # a is now the most recently used
    cache.remember([rule], ["d"], [1], refusal(0, 30_000, 0, 30_000), sent=clock.now)
    assert len(cache) == 3 and cache.answer(["b"], [1]) is None
    assert cache.forget_key("a") == 1 and cache.answer(["a"], [1]) is None
    # a refusal from a request sent before the reset finished is not kept
    assert not cache.remember([rule], ["a"], [1], refusal(0, 30_000, 0, 30_000), sent=clock.now)
    clock.now += 1
    assert cache.remember([rule], ["a"], [1], refusal(0, 30_000, 0, 30_000), sent=clock.now)
    # an admission on the same keys (a cheaper request) changed what a refusal would report
    cache.admitted(["a"])
    assert cache.answer(["a"], [1]) is None
    # costs of one identity: the newest four are kept (a cost from a header is the client's choice)
    big = Rule("r", (), "fixed_window", limit=1000, window=60.0)
    for cost in range(2, 12):
        assert cache.remember([big], ["e"], [cost], refusal(0, 30_000, 0, 30_000), sent=clock.now)
    assert [c for c in range(2, 12) if cache.answer(["e"], [c]) is not None] == [8, 9, 10, 11]


def test_held_until_redis_would_admit_less_a_margin_and_counting_down() -> None:
    clock = Clock()
    rule = Rule("r", (), "token_bucket", rate=1.0, burst=1)
    cache = LocalRefusals(10, clock=clock)
    sent = clock.now
    clock.now += 400  # the reply took 400 µs
    assert cache.remember([rule], ["k"], [1], refusal(0, 1000, 0, 1000), sent=sent)
    clock.now = sent + 500_000
    held = cache.answer(["k"], [1])
    assert held is not None and held.retry_after_ms == 501 and held.rules[0].reset_ms == 501
    clock.now = sent + 999_000 - 999 - 2  # 1 ms, 1000 ppm and 1 µs short of the rounded-up retry
    assert cache.answer(["k"], [1]) is not None
    clock.now += 1
    assert cache.answer(["k"], [1]) is None
    assert cache.answer(["k"], [1]) is None  # and it is gone


def test_what_is_not_kept() -> None:
    clock = Clock()
    cache = LocalRefusals(10, clock=clock)
    bucket = Rule("r", (), "token_bucket", rate=1.0, burst=5)
    leaky = Rule("r", (), "leaky_bucket", rate=1.0, burst=5)
    stock = Rule("r", (), "quota", limit=5)
    shadow = Rule("s", (), "fixed_window", limit=1, window=60.0, shadow=True)
    window = Rule("w", (), "fixed_window", limit=1, window=60.0)
    # remaining 1 of a cost 3: it would grow during the wait, and the header with it
    assert not cache.remember([bucket], ["k"], [3], refusal(0, 2000, 1, 4000), clock.now)
    assert cache.remember([bucket], ["k"], [3], refusal(0, 1000, 2, 4000), clock.now)
    assert not cache.remember([leaky], ["k"], [1], refusal(0, 1000, 0, 6000), clock.now)
    assert not cache.remember([stock], ["k"], [1], refusal(0, None, 0, -1, RuleOutcome.NEVER_FITS), clock.now)
    both = Decision(False, 0, 30_000, 0, (RuleState(RuleOutcome.REFUSES, 0, 30_000),
                                          RuleState(RuleOutcome.ADMITS, 0, 1)))
    assert not cache.remember([window, shadow], ["k", "s"], [1, 1], both, clock.now)
    assert not LocalRefusals(0, clock=clock).remember([window], ["k"], [1], refusal(0, 30_000, 0, 30_000), clock.now)
    # a cost above what the rule can ever hold: kept for the life of the config
    assert cache.remember([stock], ["k"], [6], refusal(0, None, 5, -1, RuleOutcome.NEVER_FITS), clock.now)
    clock.now += 10**12
    held = cache.answer(["k"], [6])
    assert held is not None and held.retry_after_ms is None


def test_bytes_per_entry() -> None:
    """What one held refusal costs (tracemalloc), for docs/algorithms.md: a 3-rule route, keys as
    the gateway builds them."""
    rules_ = [Rule("u", (), "token_bucket", rate=5.0, burst=5), Rule("i", (), "sliding_window", limit=9, window=1.0),
              Rule("g", (), "fixed_window", limit=99, window=1.0)]
    decision = Decision(False, 0, 200, 0, (RuleState(RuleOutcome.REFUSES, 0, 1000),
                                           RuleState(RuleOutcome.ADMITS, 3, 900),
                                           RuleState(RuleOutcome.ADMITS, 50, 900)))
    count = 20_000
    cache = LocalRefusals(count, clock=Clock())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(count):
        keys = [f"rlgw:{{seckill}}:user:user-{n:08d}", f"rlgw:{{seckill}}:item:item-{n % 50}", "rlgw:{seckill}:g:~"]
        # the gateway stores the Decision it received: each entry holds its own
        own = Decision(False, 0, 200, 0, tuple(RuleState(*s) for s in decision.rules))
        cache.remember(rules_, keys, [1, 1, 1], own, sent=T0)
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    assert len(cache) == count
    print(f"bytes per held refusal (3 rules): {per_entry:.0f}")
    assert per_entry < 2000


# --- end to end: real gateway processes ----------------------------------------------------------

JWT_SECRET = "refusals-test-secret-0123456789abcdef"
ROUTES = """
version: 1
redis: {{key_prefix: f{tag}}}
local_refusals: {{max_hold: {hold}}}
jwt: {{algorithms: [HS256], secret: "refusals-test-secret-0123456789abcdef"}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: token
    match: {{path: /echo/token}}
    upstream: up
    limits: [{{name: sub, by: ["jwt:sub"], algorithm: fixed_window, limit: 1, window: 1h}}]
  - name: flood
    match: {{path: /echo/flood}}
    upstream: up
    limits: [{{name: user, by: [header:X-User], algorithm: fixed_window, limit: {limit}, window: 1h}}]
  - name: cost
    match: {{path: /echo/cost}}
    upstream: up
    limits: [{{name: user, by: [header:X-User], algorithm: token_bucket, rate: 1/h, burst: 5, cost: "header:X-Cost"}}]
  - name: leaky
    match: {{path: /echo/leaky}}
    upstream: up
    limits: [{{name: user, by: [header:X-User], algorithm: leaky_bucket, rate: 1/min, burst: 1, cost: 2}}]
  - name: skip
    match: {{path: /echo/skip}}
    upstream: up
    limits:
      - {{name: user, by: [header:X-User], on_missing: skip, algorithm: fixed_window, limit: 1, window: 1h}}
      - {{name: ip, by: [ip], algorithm: fixed_window, limit: 1000, window: 1h}}
  - name: shadow
    match: {{path: /echo/shadow}}
    upstream: up
    limits:
      - {{name: user, by: [header:X-User], algorithm: fixed_window, limit: 1, window: 1h}}
      - {{name: watch, by: [], algorithm: fixed_window, limit: 1, window: 1h, shadow: true}}
  - name: stock
    match: {{path: /echo/stock}}
    upstream: up
    limits: [{{name: left, by: [header:X-User], algorithm: quota, limit: 1}}]
  - name: sharded
    match: {{path: /echo/sharded}}
    upstream: up
    shards: 4
    limits:
      - {{name: user, by: [header:X-User], algorithm: fixed_window, limit: 1, window: 1h}}
      - {{name: all, by: [], algorithm: fixed_window, limit: 100000, window: 1h}}
"""


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, own_redis: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    # held as long as Redis would refuse: these tests count Redis calls over many requests
    text = ROUTES.format(tag=uuid.uuid4().hex[:6], upstream=upstream.url, limit=2, hold="1h")
    proc = GatewayProcess(text, tmp_path_factory.mktemp("flood"), redis_url=own_redis.url)
    proc.start()
    yield proc
    assert proc.stop() == 0


def metric(gateway: GatewayProcess, sample: str) -> float:
    for line in httpx.get(gateway.admin_url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def user() -> dict[str, str]:
    return {"X-User": "u" + uuid.uuid4().hex[:10]}


def test_a_flood_of_held_refusals_never_reaches_redis(gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    who = user()
    with httpx.Client(base_url=gateway.url, headers=who) as client:
        before = decisions(own_redis)
        assert [client.get("/echo/flood").status_code for _ in range(2)] == [200, 200]
        first = client.get("/echo/flood")
        assert first.status_code == 429
        assert decisions(own_redis) == before + 3
        flood = [client.get("/echo/flood") for _ in range(200)]
        assert decisions(own_redis) == before + 3, "a held refusal asked Redis"
    # the answer from memory is Redis's: status, problem+json, Retry-After, rate-limit headers
    for later in (flood[0], flood[-1]):
        assert later.status_code == 429
        for header in ("content-type", "ratelimit-policy"):
            assert later.headers[header] == first.headers[header]
        body, first_body = later.json(), first.json()
        assert {k: v for k, v in body.items() if k != "retry_after_ms"} == \
            {k: v for k, v in first_body.items() if k != "retry_after_ms"}
        assert 0 <= first_body["retry_after_ms"] - body["retry_after_ms"] < 60_000
        assert int(later.headers["retry-after"]) == -(-body["retry_after_ms"] // 1000)
        assert later.headers["ratelimit"].startswith('"user";r=0;t=')
    assert json.loads(first.content)["detail"] == "rate limit 'user' of route 'flood' exceeded"
    sample = 'gateway_requests_total{decided_by="memory",outcome="refused",route="flood"}'
    assert metric(gateway, sample) >= 200
    rule = 'gateway_rule_decisions_total{decided_by="memory",outcome="refused",route="flood",rule="user"}'
    assert metric(gateway, rule) >= 200


def test_held_refusals_answered_before_the_app_keep_order_and_framing(
        gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    """Held refusals are answered by the server protocol itself (before the application): on a
    kept-alive connection, pipelined behind and before other requests, with a body to drop, for
    HEAD: each answer in order, framed, and the connection still in step afterwards."""
    who = user()["X-User"]
    with httpx.Client(base_url=gateway.url, headers={"X-User": who}) as client:
        assert [client.get("/echo/flood").status_code for _ in range(3)] == [200, 200, 429]  # now held

    def request(method: str, path: str, body: bytes = b"", name: str = who) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nX-User: {name}\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    other = user()["X-User"]
    before = decisions(own_redis)
    with Conn(gateway.port) as conn:
        conn.send(request("GET", "/echo/flood", name=other)   # admitted, through the app
                  + request("POST", "/echo/flood", b"x" * 5000)  # held: its body is read and dropped
                  + request("GET", "/echo/flood", name=other)   # admitted
                  + request("HEAD", "/echo/flood")              # held, and no body on a HEAD
                  + request("GET", "/echo/flood"))              # held
        answers = [conn.response(head_only=(i == 3)) for i in range(5)]
    assert [status for status, _, _ in answers] == [200, 429, 200, 429, 429]
    assert json.loads(answers[0][2])["path"] == "/echo/flood"
    assert json.loads(answers[1][2])["rule"] == "user"
    assert answers[3][2] == b"" and int(answers[3][1][b"content-length"]) > 0
    assert decisions(own_redis) == before + 2  # only the two admitted requests asked Redis


def test_an_admin_reset_admits_the_next_request_at_once(gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    who = user()
    with httpx.Client(base_url=gateway.url, headers=who) as client:
        assert [client.get("/echo/flood").status_code for _ in range(4)] == [200, 200, 429, 429]
        before = decisions(own_redis)
        assert client.get("/echo/flood").status_code == 429
        assert decisions(own_redis) == before  # held
        reset = httpx.delete(gateway.admin_url + "/limits/flood/user", params={"key": who["X-User"]})
        assert reset.status_code == 200 and reset.json()["reset"] is True
        assert client.get("/echo/flood").status_code == 200
        # a quota without period is never held (a reset through any worker lifts it): same outcome
        assert [client.get("/echo/stock").status_code for _ in range(3)] == [200, 429, 429]
        reset = httpx.delete(gateway.admin_url + "/limits/stock/left", params={"key": who["X-User"]})
        assert reset.status_code == 200
        assert client.get("/echo/stock").status_code == 200


def test_a_sharded_route_is_held_and_reset_per_shard(gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    who = user()
    with httpx.Client(base_url=gateway.url, headers=who) as client:
        assert [client.get("/echo/sharded").status_code for _ in range(2)] == [200, 429]
        before = decisions(own_redis)
        assert [client.get("/echo/sharded").status_code for _ in range(20)] == [429] * 20
        assert decisions(own_redis) == before  # held, in the shard the user's identity picked
        reset = httpx.delete(gateway.admin_url + "/limits/sharded/user", params={"key": who["X-User"]})
        assert reset.status_code == 200 and reset.json()["reset"] is True
        assert client.get("/echo/sharded").status_code == 200


def asks_redis(redis: RedisProcess, client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> int:
    """The status of one request, asserting that it was decided by Redis (one script call)."""
    before = decisions(redis)
    status = client.get(path, headers=headers).status_code
    assert decisions(redis) == before + 1, f"{path} {headers} was answered from memory"
    return status


def test_where_memory_must_not_answer(gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    who = user()
    with httpx.Client(base_url=gateway.url, headers=who) as client:
        # a cost from a header: the same cost is held, a cheaper or dearer one asks Redis
        assert asks_redis(own_redis, client, "/echo/cost", {"X-Cost": "3"}) == 200
        assert asks_redis(own_redis, client, "/echo/cost", {"X-Cost": "3"}) == 429  # 2 left: held
        before = decisions(own_redis)
        assert client.get("/echo/cost", headers={"X-Cost": "3"}).status_code == 429
        assert decisions(own_redis) == before
        assert asks_redis(own_redis, client, "/echo/cost", {"X-Cost": "4"}) == 429
        assert asks_redis(own_redis, client, "/echo/cost", {"X-Cost": "1"}) == 200   # cheaper: admitted
        # a cost that can never fit: refused by Redis once, then from memory for the life of the config
        assert asks_redis(own_redis, client, "/echo/cost", {"X-Cost": "6"}) == 429
        before = decisions(own_redis)
        never = client.get("/echo/cost", headers={"X-Cost": "6"})
        assert never.status_code == 429 and "retry-after" not in never.headers and decisions(own_redis) == before
        assert "can ever admit" in never.json()["detail"]
        # leaky_bucket: every refusal asks Redis
        assert asks_redis(own_redis, client, "/echo/leaky") == 200
        assert [asks_redis(own_redis, client, "/echo/leaky") for _ in range(3)] == [429] * 3
        # a rule sitting out: the request without its identity is not the refused one
        assert asks_redis(own_redis, client, "/echo/skip") == 200
        assert asks_redis(own_redis, client, "/echo/skip") == 429
        before = decisions(own_redis)
        assert client.get("/echo/skip").status_code == 429
        assert decisions(own_redis) == before
        with httpx.Client(base_url=gateway.url) as anonymous:
            assert asks_redis(own_redis, anonymous, "/echo/skip") == 200
        # a shadow rule in the route: its counts stay exact, so every request asks Redis
        assert asks_redis(own_redis, client, "/echo/shadow") == 200
        assert [asks_redis(own_redis, client, "/echo/shadow") for _ in range(3)] == [429] * 3
        # a quota without period: lifted only by a reset, which other workers would not see
        assert asks_redis(own_redis, client, "/echo/stock") == 200
        assert [asks_redis(own_redis, client, "/echo/stock") for _ in range(3)] == [429] * 3


def test_an_admin_reset_reaches_every_worker_within_max_hold(
        tmp_path: Path, own_redis: RedisProcess, upstream: Upstream) -> None:
    """The reset is served by one worker; the others still hold the user's refusal of a 1-hour
    window, but never past local_refusals.max_hold: by then every worker asks Redis again."""
    hold = 1.0
    text = ROUTES.format(tag=uuid.uuid4().hex[:6], upstream=upstream.url, limit=3, hold=f"{hold}s")
    gateway = GatewayProcess(text, tmp_path, redis_url=own_redis.url, workers=2)
    gateway.start()
    try:
        who = user()

        def fresh_connection() -> int:  # the kernel spreads new connections over both workers
            return httpx.get(gateway.url + "/echo/flood", headers=who).status_code

        statuses = [fresh_connection() for _ in range(40)]
        assert statuses == [200] * 3 + [429] * 37
        reset = httpx.delete(gateway.admin_url + "/limits/flood/user", params={"key": who["X-User"]})
        assert reset.status_code == 200 and reset.json()["reset"] is True
        time.sleep(hold + 0.05)
        assert [fresh_connection() for _ in range(3)] == [200] * 3, "a worker held a refusal past the reset"
    finally:
        assert gateway.stop() == 0


def test_a_reload_forgets_every_refusal(tmp_path: Path, own_redis: RedisProcess, upstream: Upstream) -> None:
    tag = uuid.uuid4().hex[:6]
    gateway = GatewayProcess(ROUTES.format(tag=tag, upstream=upstream.url, limit=1, hold="1h"), tmp_path,
                             redis_url=own_redis.url)
    gateway.start()
    try:
        with httpx.Client(base_url=gateway.url, headers=user()) as client:
            assert [client.get("/echo/flood").status_code for _ in range(2)] == [200, 429]
            before = decisions(own_redis)
            assert client.get("/echo/flood").status_code == 429
            assert decisions(own_redis) == before  # held
            gateway.config_path.write_text(ROUTES.format(tag=tag, upstream=upstream.url, limit=5, hold="1h"))
            reload = httpx.post(gateway.admin_url + "/reload")
            assert reload.status_code == 200, reload.text
            assert asks_redis(own_redis, client, "/echo/flood") == 200
    finally:
        assert gateway.stop() == 0


def test_a_repeated_request_is_answered_from_memory_with_its_own_request_id(
        gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    """The flood's fast lane (gateway/repeats.py): the same request again is answered from memory
    without being read again, and its answer is rendered once per decision; yet every answer
    carries its own X-Request-Id, or echoes the one the client sent."""
    who = user()
    with httpx.Client(base_url=gateway.url, headers=who) as client:
        assert [client.get("/echo/flood").status_code for _ in range(3)] == [200, 200, 429]
        before = decisions(own_redis)
        answers = [client.get("/echo/flood") for _ in range(50)]
        sent = [client.get("/echo/flood", headers={"X-Request-Id": "client-chosen-1"}) for _ in range(3)]
        assert decisions(own_redis) == before
    assert {a.status_code for a in answers + sent} == {429}
    ids = [a.headers["x-request-id"] for a in answers]
    assert len(set(ids)) == len(ids)
    assert [a.headers["x-request-id"] for a in sent] == ["client-chosen-1"] * 3
    bodies = [a.json() for a in answers]
    assert all(b["rule"] == "user" and b["route"] == "flood" for b in bodies)
    assert [b["retry_after_ms"] for b in bodies] == sorted((b["retry_after_ms"] for b in bodies), reverse=True)


def test_a_request_like_a_held_one_but_for_its_identity_asks_redis(
        gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    """Two requests share what was read from them only when the gateway cannot tell them apart:
    any other bytes are read again, and another identity is Redis's to decide."""
    who = user()["X-User"]
    with Conn(gateway.port) as conn:
        def ask(user_line: bytes) -> int:
            conn.send(b"GET /echo/flood HTTP/1.1\r\nHost: gw\r\n" + user_line + b"\r\n")
            return conn.response()[0]

        line = b"X-User: " + who.encode() + b"\r\n"
        assert [ask(line) for _ in range(4)] == [200, 200, 429, 429]
        before = decisions(own_redis)
        assert ask(line) == 429
        assert ask(line + b"User-Agent: other\r\n") == 429  # other bytes, the same identity: read again
        assert decisions(own_redis) == before
        assert ask(b"X-User: " + who.upper().encode() + b"\r\n") == 200  # another identity: Redis
        assert decisions(own_redis) == before + 1
        assert ask(line + line) == 400  # the identity header twice: never the held answer


def test_a_pipelined_flood_larger_than_a_read_is_answered_in_order(gateway: GatewayProcess) -> None:
    """Answered early, a connection sits out a few turns of the loop; what it sends meanwhile
    waits, and past 64 KiB its socket is paused. Nothing is lost or reordered."""
    who = user()["X-User"]
    with httpx.Client(base_url=gateway.url, headers={"X-User": who}) as client:
        assert [client.get("/echo/flood").status_code for _ in range(3)] == [200, 200, 429]
    request = f"GET /echo/flood HTTP/1.1\r\nHost: gw\r\nX-User: {who}\r\nX-Pad: {'p' * 200}\r\n\r\n".encode()
    count = 2000  # about 500 KB
    with Conn(gateway.port) as conn:
        conn.send(request * count + b"GET /echo/flood HTTP/1.1\r\nHost: gw\r\nX-User: other-" + who.encode()
                  + b"\r\nX-N: last\r\n\r\n")
        statuses = [conn.response()[0] for _ in range(count)]
        last = conn.response()
    assert statuses == [429] * count
    assert last[0] == 200 and ["x-n", "last"] in json.loads(last[2])["headers"]


def test_an_expired_token_is_not_refused_from_memory(gateway: GatewayProcess, own_redis: RedisProcess) -> None:
    """Whether a JWT identifies anyone depends on the clock: a route that reads one is never
    answered from what was read before, so a token that expires while its holder is refused from
    memory gets the 400 of an expired token, not the held 429."""
    import jwt

    expires = int(time.time()) + 2
    token = jwt.encode({"sub": uuid.uuid4().hex, "exp": expires}, JWT_SECRET, algorithm="HS256")
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}) as client:
        assert [client.get("/echo/token").status_code for _ in range(2)] == [200, 429]
        before = decisions(own_redis)
        assert [client.get("/echo/token").status_code for _ in range(20)] == [429] * 20
        assert decisions(own_redis) == before  # held
        time.sleep(max(0.0, expires + 1.1 - time.time()))
        expired = client.get("/echo/token")
    assert expired.status_code == 400
    assert "jwt:sub" in expired.json()["detail"]
