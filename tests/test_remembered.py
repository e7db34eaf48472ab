"""What is remembered between requests answers as what is computed: the canonical host
(gateway/http/request.py) and the identity token (gateway/keys.py), for any value, any scheme and
either readability, asked twice (the second time from memory), refusals included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.http.request import _canonical_host, canonical_host
from gateway.keys import _identity_token, identity_token

HOSTISH = st.one_of(
    st.binary(max_size=300),
    st.from_regex(rb"\A[A-Za-z0-9.%-]{0,40}(:[0-9]{0,6})?\Z"),
    st.from_regex(rb"\A\[[0-9a-fA-F:.]{0,20}\](:[0-9]{0,6})?\Z"),
)


def _outcome(compute: object, *args: object) -> object:
    try:
        return compute(*args)  # type: ignore[operator]
    except BadRequest as exc:
        return ("refused", str(exc))


@settings(max_examples=400, deadline=None)
@given(HOSTISH, st.sampled_from(["http", "https"]))
def test_a_remembered_host_is_the_computed_one(value: bytes, scheme: str) -> None:
    expected = _outcome(_canonical_host, value, scheme)
    assert _outcome(canonical_host, value, scheme) == expected
    assert _outcome(canonical_host, value, scheme) == expected  # from memory when it was kept


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=3), st.booleans())
def test_a_remembered_token_is_the_computed_one(parts: list[bytes], readable: bool) -> None:
    expected = _identity_token(parts, readable) if parts else "~"
    assert identity_token(parts, readable) == expected
    assert identity_token(list(parts), readable) == expected


def test_the_scheme_is_part_of_what_is_remembered() -> None:
    assert canonical_host(b"shop.example:443", "https") == b"shop.example"
    assert canonical_host(b"shop.example:443", "http") == b"shop.example:443"
