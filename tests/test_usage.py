"""gateway/usage.py's reader, by property: however a stream is cut into pieces, the usage read from
it is the same; memory stays bounded whatever the event sizes; a cut answer reads nothing."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.usage import MAX_EVENT, UsageReader, json_field

PATH = ("usage", "total_tokens")


def stream(contents: list[str], used: int | None, newline: bytes) -> bytes:
    events = [json.dumps({"choices": [{"delta": {"content": c}}], "usage": None}) for c in contents]
    events.append(json.dumps({"choices": [], **({"usage": {"total_tokens": used}} if used is not None else {})}))
    return b"".join(b"data: " + e.encode() + newline + newline for e in events) + b"data: [DONE]" + newline * 2


def read(body: bytes, cuts: list[int], whole: bool = True, content_type: str = "text/event-stream") -> object:
    reader = UsageReader([PATH], content_type)
    last = 0
    for cut in sorted({c % (len(body) + 1) for c in cuts}):
        reader.feed(body[last:cut])
        last = cut
    reader.feed(body[last:])
    return reader.end(whole)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=30), st.integers(0, 10**6), st.lists(st.integers(0, 10**6)),
       st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_cutting_reads_the_same_usage(contents: list[str], used: int, cuts: list[int], newline: bytes) -> None:
    body = stream(contents, used, newline)
    assert read(body, cuts) == {PATH: used}
    assert read(body, cuts, whole=False) is None


def test_no_usage_and_null_usage_read_nothing() -> None:
    assert read(stream(["a", "b"], None, b"\n"), [3, 50]) is None


def test_the_last_event_that_carries_it_wins() -> None:
    body = stream(["a"], 5, b"\n") + stream(["b"], 9, b"\n")
    assert read(body, [10]) == {PATH: 9}


def test_memory_is_bounded_whatever_the_event_sizes() -> None:
    reader = UsageReader([PATH], "text/event-stream")
    huge = b"data: " + b"x" * (5 * MAX_EVENT)  # an event with no end in sight
    for i in range(0, len(huge), 4096):
        reader.feed(huge[i:i + 4096])
        assert sum(map(len, reader._chunks)) <= MAX_EVENT + 65536 + 4096
    reader.feed(b"\n\n" + stream([], 11, b"\n"))
    assert reader.end(True) == {PATH: 11}


def test_a_json_answer_and_a_request_field() -> None:
    body = json.dumps({"usage": {"total_tokens": 12}}).encode()
    assert read(body, [5], content_type="application/json; charset=utf-8") == {PATH: 12}
    assert read(body, [5], content_type="text/plain") is None
    assert json_field(b'{"max_tokens": 40}', False, ("max_tokens",), 1024) == 40
    for body, more in ((b'{"max_tokens": 40}', True), (b'{"max_tokens": "40"}', False), (b"[1]", False),
                       (b'{"max_tokens": true}', False), (b'{"max_tokens": -1}', False), (b"{", False),
                       (b"[" * 5000, False), (b'{"max_tokens": 40}' + b" " * 2000, False)):
        assert json_field(body, more, ("max_tokens",), 1024) is None, body[:40]
