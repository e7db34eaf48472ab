"""The keys of identities seen before, for the HTTP doors (the proxy port, the check port, the
middleware): a caller's next requests carry the same identities (its user, its address, its key),
and what they come to — each rule's key, the specs of its shard — is a function of the route and of
those identities alone. So it is computed once and looked up after, as the RLS port remembers a
call (gateway/rls/service.py).

Only what cannot change between two requests is kept: a route whose costs a request declares (a
cost header, a token budget) is never remembered, nor a request while its route has overrides
(gateway/overrides.py, which change at any time), and the identities are read from every request.
Bounded: at most `MAX_KNOWN` per runtime, all forgotten when full: about 1.2 KB each for three rules
and a 20-byte user (tracemalloc), 2.4 MB full; identities of the longest `identity.max_length` allows
add their own bytes (a key of theirs is a digest)."""

from __future__ import annotations

from typing import NamedTuple

from gateway.config import Rule
from gateway.limiter import RuleSpec

MAX_KNOWN = 2048


class Identified(NamedTuple):
    """What a request's identities come to on its route (gateway/pipeline.py `identify`)."""

    rules: list[Rule]             # the rules this request has identities for
    keys: list[str]               # one per rule of the route ...
    costs: list[int | None]       # ... None where the rule sits out (on_missing: skip)
    args: tuple[RuleSpec, ...]    # the specs of the request's shard
    shard: int
    parts: list[tuple[bytes, ...] | None]  # per rule of the route, its identity parts as read


# a route's name and, per rule, its identity's parts as read (None: the rule sits out)
Known = tuple[str | tuple[bytes, ...] | None, ...]


class KnownIdentities:
    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[Known, Identified] = {}

    def get(self, known: Known) -> Identified | None:
        return self.entries.get(known)

    def put(self, known: Known, identified: Identified) -> None:
        entries = self.entries
        if len(entries) >= MAX_KNOWN:
            entries.clear()
        entries[known] = identified

    def __len__(self) -> int:
        return len(self.entries)
