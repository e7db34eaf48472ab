"""gateway/usage.py's readers, by property: however a stream is cut into pieces, the usage read from
it is the same; memory stays bounded whatever the event sizes; a cut answer reads nothing; a
repeated usage field reads its largest value; and a request's reserve is read as a pydantic-based
upstream reads it (pydantic is the tests' oracle, never the product's)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from gateway.errors import BadRequest
from gateway.usage import MAX_EVENT, UsageReader, asked, asking_usage

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


def test_a_json_answer() -> None:
    body = json.dumps({"usage": {"total_tokens": 12}}).encode()
    assert read(body, [5], content_type="application/json; charset=utf-8") == {PATH: 12}
    assert read(body, [5], content_type="text/plain") is None


@pytest.mark.parametrize("body", [
    b'{"usage": {"total_tokens": 900}, "usage": {"total_tokens": 5}}',
    b'{"usage": {"total_tokens": 5}, "usage": {"total_tokens": 900}}',
    b'{"usage": {"total_tokens": 900, "total_tokens": 5}}',
    b'{"usage": {"total_tokens": 900}, "usage": {"total_tokens": "lots"}}',
])
def test_a_repeated_usage_field_reads_its_largest_value(body: bytes) -> None:
    assert read(body, [7], content_type="application/json") == {PATH: 900}
    assert read(b"data: " + body + b"\n\ndata: [DONE]\n\n", [7]) == {PATH: 900}


class Oracle(BaseModel):
    """An int field as pydantic-based OpenAI-compatible servers read it (lax mode)."""

    max_tokens: int | None = None


def upstream_reads(raw: str) -> int | str | None:
    try:
        return Oracle.model_validate(json.loads(f'{{"max_tokens": {raw}}}')).max_tokens
    except (ValueError, ValidationError):
        return "refused"


def gateway_reads(raw: str) -> int | str | None:
    try:
        return asked(b'{"max_tokens": %s}' % raw.encode(), False, 4096, ("max_tokens",)).bound
    except BadRequest:
        return "refused"


SPELLED = st.one_of(
    st.integers(-10**6, 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: json.dumps(f)),
    st.integers(0, 10**6).map(lambda n: f"{n}.0"), st.integers(0, 10**6).map(lambda n: f"{n}e0"),
    st.builds(lambda pad, sign, digits, tail: json.dumps(f"{pad}{sign}{digits}{tail}{pad}"),
              st.sampled_from(["", " ", "\t", "\n", "\u00a0"]), st.sampled_from(["", "+", "-"]),
              st.sampled_from(["9000", "9_000", "09000", "9__000", "9000_", "0x2328", "9e3", "٩٠٠٠", "", "0"]),
              st.sampled_from(["", ".0", ".00", ".", ".5", "e3"])),
    st.sampled_from(["true", "false", "null", "[9000]", '{"a": 1}', '"abc"', "1e400", "-0.0"]),
    st.text(max_size=8).map(json.dumps),
)


@settings(max_examples=400, deadline=None)
@given(SPELLED)
def test_the_reserve_is_read_as_the_upstream_reads_it(raw: str) -> None:
    """Against pydantic as the oracle: every spelling it reads as N >= 1 the gateway reads as N, and
    the gateway never reads a number the upstream does not (it refuses instead)."""
    upstream, gateway = upstream_reads(raw), gateway_reads(raw)
    if isinstance(upstream, int) and upstream >= 1:
        assert gateway == upstream, raw
    elif upstream == 0 or upstream is None:
        assert gateway is None, raw  # 0 (no bound to some servers) and null: the default
    else:  # a float past 2**63 pydantic refuses is read, and refused as over any rule's max
        assert gateway == "refused" or (isinstance(gateway, int) and gateway >= 2**63), raw


def test_every_field_that_bounds_the_answer_and_every_copy_of_it() -> None:
    def bound(body: bytes) -> tuple[int | None, str, int]:
        found = asked(body, False, 4096, ("max_tokens",))
        return found.bound, found.field, found.choices

    assert bound(b'{"max_tokens": 10, "max_completion_tokens": "900"}') == (900, "max_completion_tokens", 1)
    assert bound(b'{"max_tokens": 900, "max_tokens": 10}') == (900, "max_tokens", 1)  # the first to some readers
    assert bound(b'{"max_output_tokens": 9e2, "n": "3", "best_of": 4}') == (900, "max_output_tokens", 4)
    assert bound(b'{"n": 0}') == (None, "max_tokens", 1)
    assert bound(b'{"max_tokens": 5, "n": 2, "prompt": ["a", "b", "c"]}') == (5, "max_tokens", 6)
    assert bound(b'{"max_tokens": 5, "prompt": [1, 2, 3]}') == (5, "max_tokens", 1)  # one prompt, as tokens
    assert bound(b"") == (None, "max_tokens", 1)
    nested = asked(b'{"generationConfig": {"maxOutputTokens": 50, "candidateCount": 2}}', False, 4096,
                   ("generationConfig", "maxOutputTokens"))
    assert (nested.bound, nested.choices) == (50, 2)
    for body, more, status in ((b'{"max_tokens": 40}', True, 413), (b'{"max_tokens": 40}' + b" " * 5000, False, 413),
                               (b"{", False, 400), (b"[" * 3000, False, 400),
                               (b'{"max_tokens": 1, "n": -2}', False, 400)):
        with pytest.raises(BadRequest) as refused:
            asked(body, more, 4096, ("max_tokens",))
        assert refused.value.status == status, body[:40]


def test_a_stream_as_the_upstream_reads_it_and_the_body_that_asks_for_its_usage() -> None:
    def stream(body: bytes) -> tuple[bool, bool]:
        found = asked(body, False, 4096, ("max_tokens",))
        return found.streams, found.reports

    assert stream(b'{"stream": "yes"}') == (True, False)
    assert stream(b'{"stream": "false", "stream_options": {"include_usage": true}}') == (False, True)
    assert stream(b'{"stream": 1, "stream_options": {"include_usage": "false"}}') == (True, False)
    rewritten = asking_usage(b'{"stream": true, "stream_options": {"include_usage": "no", "x": 1}, '
                             b'"t": "\\ud800 \xc3\xa9"}')
    assert json.loads(rewritten) == {"stream": True, "stream_options": {"include_usage": True, "x": 1},
                                     "t": "\ud800 \u00e9"}
