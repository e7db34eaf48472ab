"""The only place a Redis key is built.

    <prefix>:{<route>}:<rule>:<identity>

The `{<route>}` hash tag puts every key of one decision in one Cluster slot, so the one script call
works on Redis Cluster. Route, rule and prefix names are validated by config to `[A-Za-z0-9_.-]`.
Client-supplied identity parts are kept readable only when every part is short and made of safe
characters (`[A-Za-z0-9._-]`, no separator, no brace); anything else becomes `~` + a 120-bit
BLAKE2b digest of the length-prefixed parts; a rule without identity parts gets `~` alone. So no
two different identities share a key, no client can inject a tag or a separator, and no key is
longer than a fixed bound.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Sequence

_SAFE = re.compile(rb"^[A-Za-z0-9._-]{1,32}$")
MAX_READABLE = 48


def identity_token(parts: Sequence[bytes]) -> str:
    """Encode a rule's identity parts into the last segment of its key."""
    if not parts:
        return "~"  # a rule without identity; no readable token and no digest is this short
    if all(_SAFE.match(p) for p in parts):
        joined = b":".join(parts)
        if len(joined) <= MAX_READABLE:
            return joined.decode("ascii")
    digest = hashlib.blake2b(digest_size=15)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return "~" + base64.urlsafe_b64encode(digest.digest()).decode("ascii")


def hash_tag(prefix: str, route: str) -> str:
    return f"{prefix}:{{{route}}}"


def state_key(prefix: str, route: str, rule: str, token: str) -> str:
    return f"{prefix}:{{{route}}}:{rule}:{token}"


def rule_key(rule_prefix: str, parts: Sequence[bytes]) -> str:
    """A rule's key for one identity, from the rule's `state_key(prefix, route, rule, "")`
    (computed once per route) and the identity's parts."""
    return rule_prefix + identity_token(parts)
