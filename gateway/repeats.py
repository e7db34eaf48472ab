"""Requests seen before, byte for byte, and what the gateway read from them.

A flood repeats one request. The route it matched and the identity it was charged under (the keys
and costs of its rules) are functions of the request's bytes and of the config, so the second time
they need not be read again: `pipeline.decide_now` looks the request up here first and goes
straight to the refusal held in memory for it (gateway/refusals.py). Only requests that were
answered from memory are kept, so an honest client that sends each request once adds nothing.

What makes two requests the same: the peer's address (it is an identity, and it decides whether
X-Forwarded-For is believed), the HTTP version, the method, the target and query as sent, and every
header field in order, as the server protocol parsed them. Nothing derived is compared, so two
requests the gateway could tell apart never share an entry. Not kept at all: routes whose identity
reads a JWT (whether a token still identifies anyone depends on the clock) or the body.

Bounded by what Python holds, not by the bytes on the wire: an entry is counted as `ENTRY_COST`
plus, for each header field, `FIELD_COST` and the field's bytes (a field is a tuple of two bytes
objects: ~130 bytes before its first character, so 800 empty fields hold ~100 KB, not 800 bytes).
An entry counted over `MAX_ENTRY_BYTES` is not kept, and the table is emptied when it reaches
`max_entries` entries or `max_bytes` counted. tests/test_repeats.py measures what entries of
several shapes really hold (tracemalloc) against what they are counted.

A reload builds a new Runtime, hence a new table; an admin reset needs nothing here (it drops the
held refusal, and a request found here without one goes the whole way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.config import Route, Rule
from gateway.limiter import Decision

if TYPE_CHECKING:
    from gateway.outcome import Answer

FIELD_COST = 136         # one (name, value) tuple, its slot in the key and the two bytes objects' headers
ENTRY_COST = 2048        # the key tuple, its dict slot, the Seen with its keys and the refusal rendered
MAX_ENTRY_BYTES = 16 * 1024  # about 100 short fields (the server refuses more than 100)
MAX_ENTRIES = 4096
MAX_BYTES = 16 * 1024 * 1024

Key = tuple[Any, ...]


class Seen:
    """What was read from a request: its route, the rules taking part, and the route's keys and
    costs (as given to the Limiter); the client's X-Request-Id if it sent a usable one. And the
    last refusal rendered for it, with the decision it rendered: the same decision (the same
    retry, to the millisecond) is the same bytes."""

    __slots__ = ("costs", "keys", "parts", "rendered", "request_id", "route", "rules")

    def __init__(self, route: Route, rules: list[Rule], keys: list[str], costs: list[int | None],
                 request_id: bytes | None, parts: list[tuple[bytes, ...] | None]) -> None:
        self.route = route
        self.parts = parts  # each rule's identity parts, for the refusal's access log line and /top
        self.rules = rules
        self.keys = keys
        self.costs = costs
        self.request_id = request_id
        self.rendered: tuple[Decision, Answer] | None = None


def request_key(scope: Mapping[str, Any]) -> Key:
    """The request as the server protocol parsed it."""
    client = scope.get("client")
    return (client[0] if client else None, scope.get("http_version"), scope["method"], scope.get("raw_path"),
            scope.get("query_string"), tuple(scope["headers"]))


class Repeats:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.entries: dict[Key, Seen] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Key) -> Seen | None:
        return self.entries.get(key) if self.entries else None

    def put(self, key: Key, seen: Seen) -> bool:
        """Keep what was read from this request, if its entry is small enough. True if kept."""
        fields = key[5]
        size = (ENTRY_COST + FIELD_COST * len(fields) + sum(len(name) + len(value) for name, value in fields)
                + len(key[3] or b"") + len(key[4] or b""))
        if size > self.max_entry_bytes or key in self.entries:
            return False
        if len(self.entries) >= self.max_entries or self.bytes + size > self.max_bytes:
            self.entries.clear()
            self.bytes = 0
        self.entries[key] = seen
        self.bytes += size
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
