"""Token budgets (SPEC section 2): what a request reserves, read from its JSON body, and what its
answer says it used, read from the answer's JSON or from its Server-Sent Events as they stream by.

`UsageReader` sees the answer's body after each piece has gone to the client: it never holds the
stream back and never changes it. It keeps the last MAX_EVENT bytes of a stream (the usage is in
its last events) or up to MAX_JSON bytes of a JSON answer, and reads them when the answer has
ended; an event is parsed only when it gives the path's first key a value. The last event that
carries the path wins (OpenAI's final usage chunk, Anthropic's message_delta).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

MAX_EVENT = 256 * 1024      # bytes of one SSE event kept while it arrives
MAX_JSON = 1024 * 1024      # bytes of a JSON answer kept to read its usage
MAX_USED = 1_000_000_000    # a usage figure past this is no usage (a broken or hostile upstream)

Path = tuple[str, ...]


def json_field(body: bytes | None, more: bool, path: Path, limit: int) -> int | None:
    """The whole number at `path` of a JSON body read whole, of at most `limit` bytes
    (identity.body_max_bytes); None when the body is longer, not all here, not JSON, or has no
    whole number >= 0 there."""
    if body is None or more or not body or len(body) > limit:
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _number_at(document, path)


def _number_at(document: Any, path: Sequence[str]) -> int | None:
    for name in path:
        if not isinstance(document, dict):
            return None
        document = document.get(name)
    if isinstance(document, bool) or not isinstance(document, int) or not 0 <= document <= MAX_USED:
        return None
    return document


class UsageReader:
    """Reads the usage figures at `paths` from an answer's body as it streams past.

    A stream's usage is in its last events (OpenAI's final chunk, Anthropic's message_delta), so
    only the last MAX_EVENT bytes of it are kept, as the pieces that arrived (no copy while it
    streams), and read once it has ended: the stream costs a list append per piece."""

    __slots__ = ("_chunks", "_dropped", "_json", "_named", "_paths", "_size", "_sse", "found", "whole")

    def __init__(self, paths: Sequence[Path], content_type: str) -> None:
        self._paths = tuple(paths)
        # an event is parsed only when it gives a path's first key a value other than null (OpenAI's
        # stream says "usage": null in every chunk but the last)
        names = b"|".join(re.escape(name.encode()) for name in sorted({path[0] for path in self._paths}))
        self._named = re.compile(rb'"(?:' + names + rb')"[ \t\r\n]*+:[ \t\r\n]*+(?!null\b)')
        media = content_type.split(";", 1)[0].strip().lower()
        self._sse = media == "text/event-stream"
        self._json = media == "application/json" or media.endswith("+json")
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._dropped = False  # the stream's start is gone (its first kept event may be cut)
        self.found: dict[Path, int] = {}
        self.whole = False  # the answer ended as its framing said it would

    def feed(self, chunk: bytes) -> None:
        if self._sse:
            self._chunks.append(chunk)
            self._size += len(chunk)
            if self._size > MAX_EVENT + 65536:  # trimmed now and then: a piece costs an append
                while self._size - len(self._chunks[0]) >= MAX_EVENT:
                    self._size -= len(self._chunks.popleft())
                    self._dropped = True
        elif self._json:
            if self._size + len(chunk) > MAX_JSON:  # too large to read: no usage, the reserve stands
                self._json = False
                self._chunks.clear()
            else:
                self._chunks.append(chunk)
                self._size += len(chunk)

    def end(self, whole: bool) -> dict[Path, int] | None:
        """The figures of an answer that ended whole; None (the reserve stands) for one cut short,
        or one that named none of the paths."""
        self.whole = whole
        body = b"".join(self._chunks)
        self._chunks.clear()
        if not whole:
            return None
        if self._json and body:
            with contextlib.suppress(ValueError, RecursionError):
                self._read(json.loads(body))
        elif self._sse:
            self._events(body)
        return dict(self.found) or None

    def _events(self, tail: bytes) -> None:
        separators = _SEPARATORS if b"\r" in tail else _LF  # most streams end lines with LF alone
        start = _next_boundary(tail, 0, separators) if self._dropped else (0, 0)  # a cut first event: not read
        if start[0] < 0:
            return
        low = start[0] + start[1]
        for named in self._named.finditer(tail, low):
            if named.start() < low:
                continue  # in an event already read
            first = _last_boundary(tail, low, named.start(), separators)
            end, gap = _next_boundary(tail, named.start(), separators)
            if end < 0:
                end, gap = len(tail), 0  # the last event, ended by the stream's end
            self._event(tail[first:end])
            low = end + gap

    def _event(self, event: bytes) -> None:
        data = [line[5:].removeprefix(b" ") for line in event.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                .split(b"\n") if line.startswith(b"data:")]
        if not data:
            return
        try:
            document = json.loads(b"\n".join(data))
        except (ValueError, RecursionError):
            return
        self._read(document)

    def _read(self, document: Any) -> None:
        for path in self._paths:
            value = _number_at(document, path)
            if value is not None:
                self.found[path] = value


_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_LF = (b"\n\n",)


def _next_boundary(buffer: bytes | bytearray, start: int,
                   separators: tuple[bytes, ...] = _SEPARATORS) -> tuple[int, int]:
    """Where the first blank line (LF LF, CRLF CRLF or CR CR) at or after `start` begins, and its
    length; (-1, 0) when there is none."""
    best, gap = -1, 0
    for separator in separators:
        at = buffer.find(separator, start)
        if at >= 0 and (best < 0 or at < best):
            best, gap = at, len(separator)
    return best, gap


def _last_boundary(buffer: bytes | bytearray, low: int, before: int | None = None,
                   separators: tuple[bytes, ...] = _SEPARATORS) -> int:
    """Where the event that reaches `before` (default: the end) starts: just after the last blank
    line between `low` and it, or `low`."""
    start = low
    for separator in separators:
        at = buffer.rfind(separator, low, before)
        if at >= 0:
            start = max(start, at + len(separator))
    return start


class AnswerUsage:
    """One request's token budgets between the proxy, which feeds it the answer's body, and the
    settlement (gateway/admitted.py), which reads what it found once the answer has ended."""

    __slots__ = ("feed", "paths", "reader", "used")

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = paths
        self.reader: UsageReader | None = None
        self.used: dict[Path, int] | None = None  # None: the reserve stands
        self.feed: Callable[[bytes], None] = _ignore  # each piece of the answer's body, once it has gone out

    def head(self, content_type: str) -> None:
        self.reader = UsageReader(self.paths, content_type)
        self.feed = self.reader.feed

    def end(self, whole: bool) -> None:
        if self.reader is not None:
            self.used = self.reader.end(whole)


def _ignore(chunk: bytes) -> None:
    """No head yet: nothing to read."""
