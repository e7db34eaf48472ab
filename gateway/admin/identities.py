"""What `key=` names on the admin port: an identity's values (one per source of the rule), a secret
one's fingerprint kf_..., the identity as the access log and /top show it, or its digest.
"""

from __future__ import annotations

import re

from starlette.requests import Request

from gateway.admin.common import query_bytes
from gateway.api_keys import from_fingerprint
from gateway.config import Rule
from gateway.keys import secret_part

# an identity token (gateway.keys.identity_token) that is not a value a client could have sent as
# is: the digest form; a readable token is its own key= value already
TOKEN = re.compile(rb"^~[A-Za-z0-9_-]{20}$")


def key_values(request: Request, rule: Rule) -> list[bytes]:
    """`key=` as given, as bytes (%FF is 0xFF): one value per identity source, or one identity as
    the access log and /top show it (several parts joined by ':', split into its parts)."""
    values = query_bytes(request, "key")
    if len(values) == 1 and len(rule.by) > 1 and values[0].count(b":") == len(rule.by) - 1:
        return values[0].split(b":")
    return values


def as_counted(values: list[bytes], rule: Rule) -> list[bytes]:
    """Each value as its rule counts it (gateway.keys.canonical_parts): a secret source's as its
    fingerprint (given as one, or as the value), a query parameter's as gateway/identity.py reads it."""
    out = []
    for value, source in zip(values, rule.by, strict=True):
        if source.kind == "query":
            value = value.decode("utf-8", "replace").encode().strip(b" \t")
        if source.secret and from_fingerprint(value.decode("latin-1")) is None:
            value = secret_part(value)
        out.append(value)
    return out


def shown_identity(values: list[bytes], rule: Rule) -> str | None:
    """The identity as logs and /top show it, from values `as_counted` (None for a digest)."""
    if len(values) != len(rule.by):
        return None
    return ":".join(value.decode("utf-8", "backslashreplace") for value in values)


def is_token(values: list[bytes], rule: Rule) -> bool:
    """Whether `key=` is an identity's digest, as a Redis key ends."""
    return len(values) == 1 and bool(rule.by) and TOKEN.match(values[0]) is not None
