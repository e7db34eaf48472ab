"""The only place a Redis key is built.

    <prefix>:{<route>}:<rule>:<identity>                      shards: 1 (the default)
    <prefix>:{<route>:<shard>:<salt>}:<rule>:<identity>       shards: N > 1, shard in 0..N-1
    <prefix>:{~shared}:<rule>:<identity>                      a rule of `shared:`, wherever it is used
    <prefix>:{~shared}:<route>/<rule>:<identity>              the own rules of a route that uses one
    <prefix>:{~protect:<upstream>:<route>}:slots | :limit     protect: scope fleet (route * : the upstream's)

A shared rule keeps one counter for every route that names it, so its keys cannot carry a route's
tag; a route that uses one moves its own rules' keys under the same `{~shared}` tag (`~` is in no
route's name), so its decision is still one script call in one slot. The hash tag puts every key of
one decision in one Cluster slot, so the one script call works on
Redis Cluster. A sharded route has N tags, one per shard; a request's shard is `shard_of()` of its
first rule's identity parts: BLAKE2b-64 (personalised `rlgw-shard`) of the length-prefixed parts,
read big-endian, modulo N. It depends on nothing but the bytes (not on Python's hash(), the process,
the version or the platform), so every gateway sends one identity to the same shard. `<salt>` is the
smallest whole number putting the tag's slot (CRC16 mod 16384, Redis's) in the shard's N-th of the
slot space, so the N tags are evenly spaced over the slots and a cluster whose primaries own equal
slot ranges gets N/P of them each (docs/scaling.md).

Route, rule and prefix names are validated by config to `[A-Za-z0-9_.-]`.
Identity parts are kept readable only when the rule reads nothing but the client's address, the
path and the method (what an access log shows anyway: `Rule.readable_identity`) and every part is
short and made of safe characters (`[A-Za-z0-9._-]`, no separator, no brace); anything else becomes
`~` + a 120-bit BLAKE2b digest of the length-prefixed parts; a rule without identity parts gets `~`
alone. So no two different identities share a key, no client can inject a tag or a separator, no
key is longer than a fixed bound, and no header, cookie or query value, API key or claim is written
as it came to a Redis key.

A secret source's value (Source.secret: the API key, Authorization, a name that says credential,
`secret: true`) enters its key as its fingerprint, `kf_` and 16 hex digits (`secret_part`), the
one /keys shows: an operator who has only the fingerprint can still name the key's counters and
overrides. Logs, /top and the admin port show an identity with `shown()`: secret values as that
fingerprint, every other value (a user id, an address) as it came.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from gateway.config import Rule

SLOTS = 16384  # Redis Cluster's hash slots

_SAFE = re.compile(rb"^[A-Za-z0-9._-]{1,32}$")
MAX_READABLE = 48


FINGERPRINT = "kf_"


def digest(key: bytes) -> int:
    """A secret value's digest (an API key's, as /keys stores it): BLAKE2b-64, personalised."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"rlgw-api-key").digest(), "big")


def fingerprint(value: int) -> str:
    return f"{FINGERPRINT}{value:016x}"


def from_fingerprint(text: str) -> int | None:
    """The digest a fingerprint names, or None if `text` is none."""
    if len(text) == len(FINGERPRINT) + 16 and text.startswith(FINGERPRINT):
        try:
            return int(text[len(FINGERPRINT):], 16)
        except ValueError:
            return None
    return None


class KeyForm(NamedTuple):
    """How one rule's identity parts are written: `readable` (Rule.readable_identity) and, per
    source, whether its values are secret (Source.secret)."""

    readable: bool
    secret: tuple[bool, ...]


def key_form(rule: Rule) -> KeyForm:
    return KeyForm(rule.readable_identity, tuple(source.secret for source in rule.by))


def secret_part(value: bytes) -> bytes:
    """What a secret source's value is counted and shown as: its fingerprint (gateway/api_keys.py),
    which an operator may give in place of the value, as for /keys."""
    return fingerprint(digest(value)).encode()


def canonical_parts(parts: Sequence[bytes], form: KeyForm) -> Sequence[bytes]:
    """The parts a key is made of: each secret source's value as its fingerprint."""
    if not any(form.secret) or len(parts) != len(form.secret):  # on_missing: ip has a part of its own
        return parts
    return [secret_part(part) if secret else part for part, secret in zip(parts, form.secret, strict=True)]


def shown(parts: Sequence[bytes], form: KeyForm) -> str:
    """An identity as logs, /top and the admin port show it: secret values as their fingerprint,
    everything else as it came (bytes outside UTF-8 as \\x escapes), parts joined by ':'."""
    return ":".join(part.decode("utf-8", "backslashreplace") for part in canonical_parts(parts, form))


def identity_token(parts: Sequence[bytes], readable: bool) -> str:
    """Encode a rule's identity parts into the last segment of its key; `readable`: the rule's
    `readable_identity`. A one-part identity of a usual length is remembered (a caller's next
    requests carry it again): a lookup, where a digest costs a microsecond."""
    if not parts:
        return "~"  # a rule without identity; no readable token and no digest is this short
    if len(parts) == 1 and len(parts[0]) <= _REMEMBERED_PART:
        return _remembered_token(parts[0], readable)
    return _identity_token(parts, readable)


_REMEMBERED_PART = 256


@functools.lru_cache(maxsize=4096)
def _remembered_token(part: bytes, readable: bool) -> str:
    return _identity_token((part,), readable)


def _identity_token(parts: Sequence[bytes], readable: bool) -> str:
    if readable and all(_SAFE.match(p) for p in parts):
        joined = b":".join(parts)
        if len(joined) <= MAX_READABLE:
            return joined.decode("ascii")
    digest = hashlib.blake2b(digest_size=15)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return "~" + base64.urlsafe_b64encode(digest.digest()).decode("ascii")


SHARED_TAG = "~shared"


def rule_segment(route: str, rule: str, shared: bool, route_uses_shared: bool) -> str:
    """A rule's segment of its keys (see above): its own name, or `<route>/<rule>` for a route's own
    rule beside shared ones under the one `{~shared}` tag."""
    return f"{route}/{rule}" if route_uses_shared and not shared else rule


def state_key(prefix: str, route: str, rule: str, token: str, tag: str | None = None) -> str:
    """A rule's key; `tag` is one of `shard_tags(route, N)` on a sharded route (default: the route)."""
    return f"{prefix}:{{{tag or route}}}:{rule}:{token}"


def protect_keys(prefix: str, upstream: str, route: str) -> tuple[str, str]:
    """A fleet-wide protect:'s keys: the slots in flight and the limit (lua/protect.lua), one tag."""
    tag = f"{prefix}:{{~protect:{upstream}:{route}}}"
    return f"{tag}:slots", f"{tag}:limit"


def shard_of(parts: Sequence[bytes], shards: int) -> int:
    """The shard (0..shards-1) of a request whose first rule has identity `parts`."""
    if shards == 1:
        return 0
    digest = hashlib.blake2b(digest_size=8, person=b"rlgw-shard")
    for part in parts:
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "big") % shards


def slot(text: str) -> int:
    """Redis Cluster's slot of a key or hash tag: CRC16 (XMODEM) mod 16384."""
    return binascii.crc_hqx(text.encode(), 0) % SLOTS


@functools.lru_cache(maxsize=64)
def shard_tags(route: str, shards: int) -> tuple[str, ...]:
    """The hash tag of each shard of a route: `<route>` alone for one shard (keys as before sharding
    existed), else `<route>:<shard>:<salt>` with the tag's slot in the shard's part of the slots."""
    if shards == 1:
        return (route,)
    tags = []
    for shard in range(shards):
        low, high = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
        salt = 0
        while not low <= slot(f"{route}:{shard}:{salt}") < high:
            salt += 1
        tags.append(f"{route}:{shard}:{salt}")
    return tuple(tags)


def form_token(parts: Sequence[bytes], form: KeyForm) -> str:
    """The identity token of a rule of this `key_form` for the parts read from a request."""
    return identity_token(canonical_parts(parts, form), form.readable)


def rule_key(rule_prefix: str, parts: Sequence[bytes], form: KeyForm) -> str:
    """A rule's key for one identity, from the rule's `state_key(prefix, route, rule, "")`
    (computed once per route), the identity's parts and the rule's `key_form`."""
    return rule_prefix + form_token(parts, form)
