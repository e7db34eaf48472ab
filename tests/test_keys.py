"""gateway/keys.py: identity tokens (no collision, no injection, nothing a client sent kept as it came)."""

from __future__ import annotations

import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import parse_config
from gateway.keys import MAX_READABLE, identity_token, state_key

parts_lists = st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                                 st.sampled_from([b"_", b"a", b"a:b", b"~x", b"{x}", b"", b"-", b"." * 33])),
                       max_size=4)


@settings(max_examples=400, deadline=None)
@given(a=parts_lists, b=parts_lists)
def test_identity_tokens_never_collide_and_never_inject(a: list[bytes], b: list[bytes]) -> None:
    ta, tb = identity_token(a, True), identity_token(b, True)
    da, db = identity_token(a, False), identity_token(b, False)
    assert (ta == tb) == (a == b) and (da == db) == (a == b)
    assert all(token == "~" or (token.startswith("~") and len(token) == 21) for token in (da, db))  # digests
    for token in (ta, tb, da, db):
        assert "{" not in token and "}" not in token
        assert len(token) <= max(MAX_READABLE, 21)
        key = state_key("rlgw", "route", "rule", token)
        assert key.count("{") == 1 and key.count("}") == 1  # the route's hash tag is the only one


def test_identity_tokens_stay_readable_when_they_can() -> None:
    assert identity_token([], True) == "~"
    assert identity_token([b"42", b"10.0.0.1"], True) == "42:10.0.0.1"
    assert identity_token([b"_"], True) != identity_token([], True)
    assert identity_token([b"a:b"], True) != identity_token([b"a", b"b"], True)
    assert identity_token([b"x" * 33], True).startswith("~")


def test_a_value_a_client_sent_is_never_kept_as_it_came() -> None:
    """A header, cookie, query value, claim or body (an API key) is a digest in the key, the access
    log and /top; the client's address, the path and the method may stay readable."""
    config = parse_config(textwrap.dedent("""\
        version: 1
        upstreams: {up: {url: "http://127.0.0.1:1"}}
        routes:
          - name: r
            match: {path: "/r/{item}"}
            upstream: up
            limits:
              - {name: key, by: ["header:X-Api-Key"], algorithm: quota, limit: 5}
              - {name: who, by: [ip, "query:user"], algorithm: quota, limit: 5}
              - {name: where, by: [ip, "path:item", method], algorithm: quota, limit: 5}
        """), "routes.yaml", {})
    key, who, where = config.routes[0].limits
    assert not key.readable_identity and not who.readable_identity and where.readable_identity
    assert identity_token([b"sk_live_1234"], key.readable_identity).startswith("~")
    assert identity_token([b"10.0.0.1", b"7", b"GET"], where.readable_identity) == "10.0.0.1:7:GET"
