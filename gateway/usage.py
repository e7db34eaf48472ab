"""Token budgets (SPEC section 2): what a request reserves, read from its JSON body, and what its
answer says it used, read from the answer's JSON or from its Server-Sent Events as they stream by.

`UsageReader` sees the answer's body after each piece has gone to the client: it never holds the
stream back and never changes it. It keeps at most MAX_EVENT bytes of an event not yet ended (a
larger event is skipped whole, the stream goes on) or MAX_JSON bytes of a JSON answer; an event is
parsed only when it names the path's first key, so a long stream of content events costs a byte
search each. The last event that carries the path wins (OpenAI's final usage chunk, Anthropic's
message_delta).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
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
    """Reads the usage figures at `paths` from an answer's body as it streams past."""

    __slots__ = ("_buffer", "_done", "_keys", "_paths", "_skipping", "_sse", "found", "whole")

    def __init__(self, paths: Sequence[Path], content_type: str) -> None:
        self._paths = tuple(paths)
        self._keys = tuple({b'"' + path[0].encode() + b'"' for path in self._paths})
        media = content_type.split(";", 1)[0].strip().lower()
        self._sse = media == "text/event-stream"
        self._buffer = bytearray()
        self._skipping = False  # inside an event past MAX_EVENT: dropped up to its end
        self._done = not self._sse and not (media == "application/json" or media.endswith("+json"))
        self.found: dict[Path, int] = {}
        self.whole = False  # the answer ended as its framing said it would

    def feed(self, chunk: bytes) -> None:
        if self._done:
            return
        if not self._sse:
            if len(self._buffer) + len(chunk) > MAX_JSON:
                self._done = True
                self._buffer = bytearray()
            else:
                self._buffer += chunk
            return
        buffer = self._buffer
        buffer += chunk
        while True:
            if self._skipping:  # inside an event too large to keep: dropped up to its end
                end, gap = _next_boundary(buffer, 0)
                if end < 0:
                    del buffer[:max(0, len(buffer) - 3)]  # a boundary may straddle the cut
                    return
                del buffer[:end + gap]
                self._skipping = False
            at = min((found for key in self._keys if (found := buffer.find(key)) >= 0), default=-1)
            if at < 0:  # no event here names the path: keep only the event still arriving
                start = _last_boundary(buffer)
                if start > 0:
                    del buffer[:start]
                break
            start = _last_boundary(buffer, at)
            end, gap = _next_boundary(buffer, at)
            if end < 0:  # the event that names it is still arriving
                if start > 0:
                    del buffer[:start]
                break
            self._event(bytes(buffer[start:end]))
            del buffer[:end + gap]
        if len(buffer) > MAX_EVENT:
            self._skipping = True
            del buffer[:max(0, len(buffer) - 3)]

    def _event(self, event: bytes) -> None:
        if not any(_named(event, key) for key in self._keys):
            return
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

    def end(self, whole: bool) -> dict[Path, int] | None:
        """The figures of an answer that ended whole; None (the reserve stands) for one cut short,
        or one that named none of the paths."""
        self.whole = whole
        if not whole:
            return None
        if not self._sse and not self._done and self._buffer:
            with contextlib.suppress(ValueError, RecursionError):
                self._read(json.loads(bytes(self._buffer)))
            self._buffer = bytearray()
        return dict(self.found) or None


def _named(event: bytes, key: bytes) -> bool:
    """Whether `event` gives `key` a value other than null (OpenAI's stream says `"usage": null`
    in every chunk but the last: those are not parsed)."""
    at = event.find(key)
    while at >= 0:
        rest = event[at + len(key):at + len(key) + 16].lstrip(b" \t:")
        if not rest.startswith(b"null"):
            return True
        at = event.find(key, at + len(key))
    return False


_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def _next_boundary(buffer: bytearray, start: int) -> tuple[int, int]:
    """Where the first blank line (LF LF, CRLF CRLF or CR CR) at or after `start` begins, and its
    length; (-1, 0) when there is none."""
    best, gap = -1, 0
    for separator in _SEPARATORS:
        at = buffer.find(separator, start)
        if at >= 0 and (best < 0 or at < best):
            best, gap = at, len(separator)
    return best, gap


def _last_boundary(buffer: bytearray, before: int | None = None) -> int:
    """Where the event that reaches `before` (default: the end) starts: just after the last blank
    line before it, or 0."""
    start = 0
    for separator in _SEPARATORS:
        at = buffer.rfind(separator, 0, before)
        if at >= 0:
            start = max(start, at + len(separator))
    return start


class AnswerUsage:
    """One request's token budgets between the proxy, which feeds it the answer's body, and the
    settlement (gateway/admitted.py), which reads what it found once the answer has ended."""

    __slots__ = ("paths", "reader", "used")

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = paths
        self.reader: UsageReader | None = None
        self.used: dict[Path, int] | None = None  # None: the reserve stands

    def head(self, content_type: str) -> None:
        self.reader = UsageReader(self.paths, content_type)

    def feed(self, chunk: bytes) -> None:
        if self.reader is not None:
            self.reader.feed(chunk)

    def end(self, whole: bool) -> None:
        if self.reader is not None:
            self.used = self.reader.end(whole)
