"""Token budgets: what a request reserves, read from its JSON body, and what its answer says it
used, read from the answer's JSON or from its Server-Sent Events as they stream by.

The reserve is read as the upstream reads it (`reserve`): every spelling pydantic's lax mode reads
as a whole number, every field that bounds the answer and every copy of a repeated key (the largest
counts), times the answers asked for; what cannot be read so is refused, never reserved at the
default (docs/algorithms.md, "How the reserve is read").

`UsageReader` sees the answer's body after each piece has gone to the client: it never holds the
stream back and never changes it. It keeps the last MAX_EVENT bytes of a stream (the usage is in
its last events) or up to MAX_JSON bytes of a JSON answer, and reads them when the answer has
ended; an event is parsed only when it gives the path's first key a value. The last event that
carries the path wins (OpenAI's final usage chunk, Anthropic's message_delta).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.errors import BadRequest

if TYPE_CHECKING:
    from gateway.config import Rule
    from gateway.identity import RequestView

MAX_EVENT = 256 * 1024      # bytes of one SSE event kept while it arrives
MAX_JSON = 1024 * 1024      # bytes of a JSON answer kept to read its usage
MAX_USED = 1_000_000_000    # a usage figure past this is no usage (a broken or hostile upstream)

Path = tuple[str, ...]


# Fields that bound an answer's tokens, read beside the reserve's own field when it is one of them
# (OpenAI's Chat Completions and Responses, Gemini); fields that multiply it (answers asked for)
BOUNDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "maxOutputTokens")
CHOICES = ("n", "best_of", "candidateCount", "candidate_count")
_WHOLE = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")  # what pydantic's lax int reads of a string
_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})  # ... and its lax bool, lowercased


class BodyTooLarge(BadRequest):
    status = 413


class Repeated(list[Any]):
    """Every value of a key an object holds more than once: readers disagree on which one counts
    (Python's json keeps the last, others the first)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name not in out:
            out[name] = value
        elif isinstance(out[name], Repeated):
            out[name].append(value)
        else:
            out[name] = Repeated([out[name], value])
    return out


def parse(body: bytes) -> Any:
    """JSON with every value of a repeated key kept (`Repeated`). Raises ValueError, RecursionError."""
    return json.loads(body, object_pairs_hook=_object)


def values(document: Any, path: Sequence[str]) -> list[Any]:
    """Every value at `path`, through every value of a repeated key on the way."""
    found = [document]
    for name in path:
        found = [item for node in found if isinstance(node, dict) and name in node
                 for item in (node[name] if isinstance(node[name], Repeated) else (node[name],))]
    return found


def whole_number(value: Any) -> int | None:
    """A JSON value as pydantic reads an int field in lax mode (9000, "9000", 9000.0, 9e3, " +9_000 ",
    true); None for null. Raises ValueError for what it would refuse, and for what others might read
    differently ("9e3", "0x2328", 2.5)."""
    if value is None:
        return None
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 64 and _WHOLE.fullmatch(value.strip()):
        return int(value.strip().split(".", 1)[0])
    raise ValueError(value)


def truthy(value: Any) -> bool:
    """Whether pydantic's lax bool reads `value` as true."""
    if isinstance(value, bool | int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE


class Asked(NamedTuple):
    """What a request's JSON body asks of the upstream, for its token reserve."""

    bound: int | None   # the largest field that bounds each answer; None: none given
    field: str          # ... its name
    choices: int        # answers asked for (n, best_of, a list of prompts), at least 1
    streams: bool       # "stream": true, as the upstream reads it
    reports: bool       # stream_options.include_usage: true, as the upstream reads it


def asked(body: bytes | None, more: bool, limit: int, path: Path) -> Asked:
    """What the body asks, read as the upstream reads it (`whole_number`). Raises BodyTooLarge for a
    body of more than `limit` bytes (identity.body_max_bytes), BadRequest for one that is not JSON or
    a value that is not a whole number >= 0."""
    if body is None or more or len(body) > limit:
        raise BodyTooLarge(f"the request body is longer than the {limit} bytes read for its token reserve "
                           f"'{path[-1]}' (identity.body_max_bytes)")
    if not body.strip():
        return Asked(None, path[-1], 1, False, False)
    try:
        document = parse(body)
    except (ValueError, RecursionError):
        raise BadRequest(f"the request body is not JSON: its token reserve '{path[-1]}' cannot be read") from None
    parents = values(document, path[:-1])
    names = BOUNDS if path[-1] in BOUNDS else (path[-1],)
    bound, field = None, path[-1]
    for name in names:
        for number in _numbers(parents, name):
            if number and (bound is None or number > bound):  # 0: no bound to some servers
                bound, field = number, name
    choices = max((number for name in CHOICES for number in _numbers(parents, name)), default=1)
    choices = max(choices, 1) * max((_prompts(value) for value in _each(parents, "prompt")), default=1)
    streams = any(truthy(value) for value in values(document, ("stream",)))
    reporting = values(document, ("stream_options", "include_usage"))
    reports = bool(reporting) and all(truthy(value) for value in reporting)
    return Asked(bound, field, choices, streams, reports)


def _prompts(prompt: Any) -> int:
    """Completions asked for by a legacy `prompt`: one per string or token list of a list of them."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, str | list) for item in prompt):
        return len(prompt)
    return 1


def _each(parents: list[Any], name: str) -> list[Any]:
    return [value for parent in parents for value in values(parent, (name,))]


def _numbers(parents: list[Any], name: str) -> list[int]:
    out = []
    for value in _each(parents, name):
        try:
            number = whole_number(value)
        except ValueError:
            raise BadRequest(f"'{name}' must be a whole number >= 0, as the upstream reads it; got "
                             f"{json.dumps(value)[:40]}") from None
        if number is not None:
            if number < 0:
                raise BadRequest(f"'{name}' must be a whole number >= 0; got {number}")
            out.append(number)
    return out


OPENAI_TOTAL = ("usage", "total_tokens")


def reserve(rule: Rule, view: RequestView) -> int:
    """What a token budget reserves for this request: the largest bound (else the default) times
    the answers asked for, and on a `total_tokens` budget the prompt, bounded by the body's bytes.
    A stream settled on OpenAI's usage that did not ask for it gets the body that does (`view`'s
    body and framing changed: what is forwarded). Raises BodyTooLarge, BadRequest."""
    assert rule.reserve_field is not None
    request = asked(view.body_prefix, view.body_more, view.config.body_digest_max_bytes, rule.reserve_field)
    tokens = (rule.cost if request.bound is None else request.bound) * request.choices
    why = f"'{request.field}' {request.bound}" if request.bound is not None else f"the default {rule.cost}"
    why += f" x {request.choices} answers" if request.choices > 1 else ""
    if rule.settle_field is not None and rule.settle_field[-1] == "total_tokens":
        if rule.settle_field == OPENAI_TOTAL and request.streams and not request.reports:
            _ask_usage(view)
        tokens += len(view.body_prefix or b"")  # the prompt: never more tokens than bytes
        why += f" and a prompt of {len(view.body_prefix or b'')} bytes"
    most = min(rule.reserve_max or rule.capacity, rule.capacity)
    if tokens > most:
        raise BadRequest(f"{why} reserve {tokens} tokens; rule '{rule.name}' takes at most {most}")
    return tokens


def _ask_usage(view: RequestView) -> None:
    """The body forwarded (by the proxy, or to the app by the middleware) asks for the usage."""
    view.body_prefix = asking_usage(view.body_prefix or b"")
    view.request.content_length, view.request.chunked = len(view.body_prefix), False
    view.request.body_rewritten = True


def asking_usage(body: bytes) -> bytes:
    """The body with `stream_options.include_usage: true`, so that the stream's last chunk carries
    the usage (OpenAI's); re-encoded as Python's json reads it (a repeated key: its last value)."""
    document = json.loads(body)
    options = document.get("stream_options")
    document["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
        "include_usage": True}
    try:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): kept as its escape
        return json.dumps(document, separators=(",", ":")).encode()


def _number_at(document: Any, path: Sequence[str]) -> int | None:
    """The largest usage figure at `path` (a repeated field: its largest value); None if none."""
    found = None
    for value in values(document, path):
        try:
            number = whole_number(value)
        except ValueError:
            continue
        if number is not None and 0 <= number <= MAX_USED and (found is None or number > found):
            found = number
    return found


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
                self._read(parse(body))
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
            document = parse(b"\n".join(data))
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
