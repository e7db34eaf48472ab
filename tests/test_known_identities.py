"""An identity seen before comes to what it came to the first time (gateway/known_identities.py): for
any route of the shapes a file can give (several parts, a secret source, on_missing skip and ip, a
sharded route, a cost header), any run of requests with any identities, the pipeline's rules, keys,
costs, specs and shard are those computed afresh, refusals (400s) included; a route with overrides
is never answered from memory, whatever was remembered before they came."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Config, parse_config
from gateway.errors import BadRequest, IdentityMissing
from gateway.http.request import read_request
from gateway.identity import RequestView
from gateway.known_identities import MAX_KNOWN, KnownIdentities
from gateway.overrides import entry
from gateway.pipeline import identify
from gateway.plan import RoutePlan, route_plan

ROUTES = """
version: 1
identity: {max_length: 12}
routes:
  - name: parts
    match: {path: /parts}
    limits:
      - {name: pair, by: [header:X-User, "query:item"], algorithm: fixed_window, limit: 5, window: 1m}
      - {name: key, by: [{header: X-Tenant, secret: true}], on_missing: skip, algorithm: gcra, rate: 5/s, burst: 5}
      - {name: ip, by: [ip], algorithm: sliding_window, limit: 9, window: 1s}
  - name: fallback
    match: {path: /fallback}
    shards: 3
    limits:
      - {name: user, by: [header:X-User], on_missing: ip, algorithm: token_bucket, rate: 3/s, burst: 3}
      - {name: all, by: [], algorithm: sliding_window, limit: 30, window: 1s}
  - name: declared
    match: {path: /declared}
    limits:
      - {name: user, by: [header:X-User], cost: header:X-Cost, algorithm: token_bucket, rate: 3/s, burst: 9}
"""
CONFIG = parse_config(ROUTES, "routes.yaml", {}, proxy=False)
PLANS = {route.name: route_plan(route, "k", None) for route in CONFIG.routes}

VALUE = st.one_of(st.none(), st.sampled_from([b"alice", b"bob", b"", b"x" * 13, b"ab:cd"]))
REQUEST = st.tuples(st.sampled_from(sorted(PLANS)), VALUE, VALUE, st.sampled_from([b"", b"item=1", b"item=2"]),
                    st.sampled_from(["10.0.0.1", "192.0.2.7"]), st.sampled_from([None, b"1", b"4", b"x"]))


def _view(config: Config, headers: list[tuple[bytes, bytes]], query: bytes, peer: str) -> RequestView:
    scope = {"type": "http", "method": "GET", "path": "/", "raw_path": b"/", "query_string": query,
             "headers": [(b"host", b"api.example"), *headers], "client": (peer, 1), "http_version": "1.1"}
    return RequestView(read_request(scope), {}, config, None)


def _asked(request: tuple[str, bytes | None, bytes | None, bytes, str, bytes | None]) -> tuple[RoutePlan, RequestView]:
    route, user, tenant, query, peer, cost = request
    headers = [(name, value) for name, value in ((b"x-user", user), (b"x-tenant", tenant), (b"x-cost", cost))
               if value is not None]
    return PLANS[route], _view(CONFIG, headers, query, peer)


def _outcome(compute: Any, *args: Any) -> Any:
    try:
        return tuple(compute(*args))
    except (IdentityMissing, BadRequest) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(st.lists(REQUEST, min_size=1, max_size=12))
def test_an_identity_seen_before_comes_to_what_is_computed(requests: list[Any]) -> None:
    known = KnownIdentities()
    for request in requests * 2:  # every identity a second time at least
        plan, view = _asked(request)
        assert _outcome(identify, plan, view, None, known) == _outcome(identify, plan, view, None)


def test_a_declared_cost_is_read_from_every_request() -> None:
    known = KnownIdentities()
    plan = PLANS["declared"]
    costs = [identify(plan, _view(CONFIG, [(b"x-user", b"alice"), (b"x-cost", cost)], b"", "10.0.0.1"), None,
                      known).costs for cost in (b"4", b"1")]
    assert costs == [[4], [1]] and len(known) == 0


def test_a_route_s_overrides_are_applied_whatever_was_remembered_before_them() -> None:
    known = KnownIdentities()
    plan = PLANS["parts"]
    alice = _view(CONFIG, [(b"x-user", b"alice")], b"item=1", "10.0.0.1")
    remembered = identify(plan, alice, None, known)
    assert len(known) == 1 and identify(plan, alice, None, known) is remembered
    token = remembered.keys[0].rsplit(":", 1)[1]
    table = {0: {token: entry(plan, 0, '{"limit": 50, "window": "1m"}')}}
    overridden = identify(plan, alice, table, known)
    assert overridden.args[0].p1 == 50 and overridden.rules[0].limit == 50
    assert remembered.args[0].p1 == 5                      # the file's, still, without the override
    unlimited = identify(plan, alice, {0: {token: entry(plan, 0, '{"unlimited": true}')}}, known)
    assert unlimited.costs[0] is None and [rule.name for rule in unlimited.rules] == ["ip"]
    assert identify(plan, alice, {}, known) is remembered  # the overrides gone: the file's again


def test_what_is_remembered_is_bounded() -> None:
    known = KnownIdentities()
    plan = PLANS["parts"]
    for i in range(MAX_KNOWN + 10):
        identify(plan, _view(CONFIG, [(b"x-user", b"u%d" % i)], b"item=1", "10.0.0.1"), None, known)
    assert 0 < len(known) <= MAX_KNOWN


@pytest.mark.parametrize("user", [b"x" * 13, None])
def test_a_refused_identity_is_never_remembered(user: bytes | None) -> None:
    known = KnownIdentities()
    headers = [(b"x-user", user)] if user is not None else []
    with pytest.raises((BadRequest, IdentityMissing)):
        identify(PLANS["parts"], _view(CONFIG, headers, b"item=1", "10.0.0.1"), None, known)
    assert len(known) == 0
