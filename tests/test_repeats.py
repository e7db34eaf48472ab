"""gateway/repeats.py: what was read from a request is kept only for a request the gateway cannot
tell apart from it, and the table stays within its bounds whatever a client sends."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from gateway.config import Route
from gateway.limiter import Decision, RuleOutcome, RuleState
from gateway.outcome import Answer, RequestOutcome
from gateway.repeats import MAX_BYTES, MAX_ENTRY_BYTES, Repeats, Seen, request_key

ROUTE = Route(name="r", path="/x", methods=None, host=None, upstream=None, limits=())


def scope(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "client": ("10.0.0.1", 4000), "http_version": "1.1", "method": "GET", "raw_path": b"/x",
        "query_string": b"", "headers": [(b"host", b"gw"), (b"x-user", b"alice")],
    }
    base.update(changes)
    return base


def seen() -> Seen:
    return Seen(ROUTE, [], [], [], None, [])


def test_only_the_same_request_finds_what_was_read() -> None:
    repeats = Repeats()
    assert repeats.put(request_key(scope()), seen())
    assert repeats.get(request_key(scope(client=("10.0.0.1", 5999)))) is not None  # another port only
    for other in (
        scope(client=("10.0.0.2", 4000)),                                  # another peer
        scope(http_version="1.0"),
        scope(method="POST"),
        scope(raw_path=b"/x/"),
        scope(query_string=b"a=1"),
        scope(headers=[(b"host", b"gw"), (b"x-user", b"alicE")]),
        scope(headers=[(b"x-user", b"alice"), (b"host", b"gw")]),         # the same fields, in another order
        scope(headers=[(b"host", b"gw"), (b"x-user", b"alice"), (b"x-user", b"alice")]),
    ):
        assert repeats.get(request_key(other)) is None, other


def test_a_large_head_is_not_kept() -> None:
    repeats = Repeats()
    big = scope(headers=[(b"host", b"gw"), (b"x-pad", b"p" * MAX_ENTRY_BYTES)])
    assert not repeats.put(request_key(big), seen())
    assert len(repeats) == 0


def test_the_table_is_emptied_at_its_bounds() -> None:
    repeats = Repeats(max_entries=10, max_bytes=10**6)
    for n in range(10):
        assert repeats.put(request_key(scope(raw_path=b"/x/%d" % n)), seen())
    assert len(repeats) == 10
    assert repeats.put(request_key(scope(raw_path=b"/x/new")), seen())
    assert len(repeats) == 1  # emptied, then the new one kept
    repeats = Repeats(max_entries=10, max_bytes=25_000)
    pad = [(b"host", b"gw"), (b"x-pad", b"p" * 8000)]  # about 10 KB counted each
    for n in range(3):
        assert repeats.put(request_key(scope(raw_path=b"/y/%d" % n, headers=pad)), seen())
    assert repeats.bytes <= 25_000
    assert len(repeats) == 1  # the third would have passed max_bytes: emptied first


def parsed(n: int, fields: list[tuple[bytes, bytes]], fresh: bool = True) -> dict[str, Any]:
    """A request's scope with fresh objects, as the server protocol builds one (names lowered);
    `fresh=False`: fresh field tuples only (the least an entry can hold, and quicker to build)."""
    if fresh:
        headers = [(bytes(bytearray(name)).lower(), bytes(bytearray(value))) for name, value in fields]
    else:
        headers = [(name, value) for name, value in fields]
    return scope(client=(f"10.0.{n // 250}.{n % 250}", 4000), raw_path=b"/x/%d" % n, headers=headers)


def held(n: int) -> Seen:
    entry = Seen(ROUTE, [], [f"rlgw:r:rule:user-{n}"], [1], None, [None])
    headers = [(b"content-type", b"application/problem+json"), (b"content-length", b"252"), (b"retry-after", b"1"),
               (b"ratelimit-policy", b'"rule";q=10;w=60'), (b"ratelimit", b'"rule";r=0;t=1')]
    decision = Decision(False, 0, 1000, 0, (RuleState(RuleOutcome.REFUSES, 0, 1000),))
    entry.rendered = (decision, Answer(429, headers, b"{" + b"x" * 250 + b"}", RequestOutcome.REFUSED, "r", "rule",
                                       identity=f"user-{n}"))
    return entry


def held_memory(count: int, fields: list[tuple[bytes, bytes]], repeats: Repeats, fresh: bool = True) -> int:
    """Bytes Python still holds after `count` distinct requests were put (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(count):
            repeats.put(request_key(parsed(n, fields, fresh)), held(n))
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


SHAPES = {
    "800-empty-fields": [(b"a", b"")] * 800,
    "90-empty-fields": [(b"a", b"")] * 90,
    "one-field": [(b"host", b"gw")],
    "browser": [(b"Host", b"shop.example"), (b"User-Agent", b"Mozilla/5.0 (X11; Linux x86_64; rv:120.0) Firefox/120.0"),
                (b"Accept", b"text/html,application/xhtml+xml"), (b"Cookie", b"sid=" + b"s" * 300)]
               + [(b"X-Field-%d" % i, b"value-%d" % i) for i in range(12)],
    "long-values": [(b"x-a", b"v" * 2000), (b"x-b", b"w" * 3000)],
}


@pytest.mark.parametrize("fields", SHAPES.values(), ids=SHAPES.keys())
def test_an_entry_is_counted_at_least_what_python_holds_for_it(fields: list[tuple[bytes, bytes]]) -> None:
    repeats = Repeats(max_entries=10**9, max_bytes=10**12, max_entry_bytes=10**9)  # every entry kept
    real = held_memory(200, fields, repeats)
    assert real <= repeats.bytes, f"{real / 200:.0f} bytes held per entry, {repeats.bytes / 200:.0f} counted"


def test_distinct_heads_of_many_empty_fields_stay_within_the_bound() -> None:
    """The probe: one refused client, 4,000 distinct heads of 800 empty fields (RSS 54 -> 253 MiB
    before). And heads just small enough to be kept: the table holds no more than its bound."""
    for fields in ([(b"a", b"")] * 800, [(b"a", b"")] * 90):
        repeats = Repeats()
        assert held_memory(4000, fields, repeats, fresh=False) <= MAX_BYTES
