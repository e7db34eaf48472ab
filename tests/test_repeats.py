"""gateway/repeats.py: what was read from a request is kept only for a request the gateway cannot
tell apart from it, and the table stays within its bounds whatever a client sends."""

from __future__ import annotations

from typing import Any

from gateway.config import Route
from gateway.repeats import MAX_HEAD_BYTES, Repeats, Seen, request_key

ROUTE = Route(name="r", path="/x", methods=None, host=None, upstream=None, limits=())


def scope(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "client": ("10.0.0.1", 4000), "http_version": "1.1", "method": "GET", "raw_path": b"/x",
        "query_string": b"", "headers": [(b"host", b"gw"), (b"x-user", b"alice")],
    }
    base.update(changes)
    return base


def seen() -> Seen:
    return Seen(ROUTE, [], [], [], None)


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
    big = scope(headers=[(b"host", b"gw"), (b"x-pad", b"p" * MAX_HEAD_BYTES)])
    assert not repeats.put(request_key(big), seen())
    assert len(repeats) == 0


def test_the_table_is_emptied_at_its_bounds() -> None:
    repeats = Repeats(max_entries=10, max_bytes=10_000)
    for n in range(10):
        assert repeats.put(request_key(scope(raw_path=b"/x/%d" % n)), seen())
    assert len(repeats) == 10
    assert repeats.put(request_key(scope(raw_path=b"/x/new")), seen())
    assert len(repeats) == 1  # emptied, then the new one kept
    pad = [(b"host", b"gw"), (b"x-pad", b"p" * 4000)]
    for n in range(3):
        repeats.put(request_key(scope(raw_path=b"/y/%d" % n, headers=pad)), seen())
    assert repeats.bytes <= 10_000
    assert len(repeats) == 1  # the third would have passed max_bytes: emptied first
