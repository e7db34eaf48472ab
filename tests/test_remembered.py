"""What is remembered between requests answers as what is computed: the canonical host
(gateway/http/request.py), the identity token (gateway/keys.py) and an RLS call as read
(gateway/rls/service.py), for any value, any scheme and either readability, any message and any
identity.max_length, asked twice (the second time from memory), refusals included."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.http.request import _canonical_host, canonical_host
from gateway.keys import _identity_token, identity_token
from gateway.rls import messages as pb
from gateway.rls.service import Call, GrpcError, _read_call, read_call

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
    except GrpcError as exc:
        return ("refused", exc.status, exc.message)


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


TEXT = st.text(st.sampled_from("ab:/é\x00"), max_size=12)
ENTRIES = st.lists(st.tuples(TEXT, TEXT), max_size=3)
DESCRIPTORS = st.lists(st.tuples(ENTRIES, st.none() | st.integers(0, 2**31), st.none() | st.integers(0, 9)),
                       max_size=3)


def _call(domain: str, hits: int, descriptors: list[tuple[list[tuple[str, str]], int | None, int | None]]) -> bytes:
    message = pb.RateLimitRequest(domain=domain, hits_addend=hits)
    for entries, cost, unit in descriptors:
        descriptor = message.descriptors.add()
        for key, value in entries:
            descriptor.entries.add(key=key, value=value)
        if cost is not None:
            descriptor.hits_addend.value = cost
        if unit is not None:
            descriptor.limit.requests_per_unit, descriptor.limit.unit = 10, unit
    return bytes(message.SerializeToString())


def _read(body: bytes, limit: int) -> object:
    """read_call's Call (not whether it was remembered), or its refusal."""
    found = _outcome(read_call, body, limit)
    return found[0] if isinstance(found, tuple) and isinstance(found[0], Call) else found


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["", "bench"]), st.integers(0, 2**31), DESCRIPTORS, st.sampled_from([4, 8, 1024]),
       st.binary(max_size=8))
def test_a_remembered_rls_call_is_the_one_read(domain: str, hits: int,
                                               descriptors: list[tuple[list[tuple[str, str]], int | None, int | None]],
                                               identity_max: int, noise: bytes) -> None:
    for body in (_call(domain, hits, descriptors), noise):
        for limit in (identity_max, 1024):  # a value remembered under one length limit is checked under another
            expected = _outcome(_read_call, body, limit)
            for _ in range(3):  # seen once, seen again (remembered), remembered
                assert _read(body, limit) == expected


def test_an_rls_call_is_remembered_from_its_second_sight_and_one_seen_once_is_not() -> None:
    body = _call("bench", 1, [([("user", uuid.uuid4().hex)], None, None)])
    first, remembered = read_call(body, 1024)
    assert not remembered
    second, remembered = read_call(body, 1024)
    assert remembered and second == first
    third, remembered = read_call(body, 1024)
    assert remembered and third is second  # the same object: what it counts is remembered by its id
    others = [read_call(_call("bench", 1, [([("user", uuid.uuid4().hex)], None, None)]), 1024) for _ in range(100)]
    assert not any(remembered for _, remembered in others)
