"""The `by:` sources -> each rule's identity parts, from one request. Trusted proxies live here.

Everything read from the request is hostile: lengths are bounded, values stay bytes until
`keys.identity_token` encodes them, and X-Forwarded-For is believed only from a trusted peer.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

import jwt as pyjwt

from gateway.config import Conditions, Config, JwtSettings, Route, Rule, Source
from gateway.errors import BadRequest, IdentityMissing
from gateway.http.request import Request
from gateway.typed_values import canonical_bytes

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_XFF_HOPS = 32
MAX_PAIRS = 256  # query parameters or cookies read for identities


def client_ip(peer: str, xff: bytes | None, trusted: Sequence[Network]) -> str:
    """The client address: the peer, or, when the peer is a trusted proxy, the right-most
    X-Forwarded-For address that is not itself a trusted proxy."""
    if not trusted or xff is None or not _is_trusted(peer, trusted):
        return peer
    hops = xff.decode("latin-1").split(",")[-MAX_XFF_HOPS:]
    candidate = peer
    for hop in reversed(hops):
        text = hop.strip()
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            return candidate  # garbage in the chain: trust nothing left of it
        candidate = str(address)
        if not any(address in net for net in trusted):
            return candidate
    return candidate


def _is_trusted(peer: str, trusted: Sequence[Network]) -> bool:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in net for net in trusted)


NOT_BEFORE_LEEWAY = 30.0  # seconds a token's `nbf`/`iat` may lie ahead of this clock (an IdP's clock skew)
FOREVER = float("inf")


class JwtVerifier:
    """Verifies bearer tokens; only a verified token yields claims.

    Results are cached only while they stay true: a yes until the token's `exp` (plus the
    configured leeway), a no for a token not valid yet until it may be, other nos for good (a bad
    signature, an expired token). `nbf` and `iat` may lie up to NOT_BEFORE_LEEWAY seconds ahead
    (or the configured leeway, if larger), as IdPs' clocks drift: PyJWT's `leeway`, applied to
    not-before only, so it never stretches an expiry.
    """

    def __init__(self, settings: JwtSettings, cache_size: int = 4096) -> None:
        self.settings = settings
        self.key: Any = settings.secret if settings.secret else settings.public_key
        self.cache: dict[bytes, tuple[dict[str, Any] | None, float]] = {}  # token -> (claims, true until)
        self.cache_size = cache_size

    def claims(self, header_value: bytes | None) -> dict[str, Any] | None:
        if not header_value or not self.settings.algorithms:
            return None
        token = header_value
        if token[:7].lower() == b"bearer ":
            token = token[7:].strip()
        if len(token) > 8192:
            return None
        now = time.time()
        cached = self.cache.get(token)
        if cached is not None and now < cached[1]:
            return cached[0]
        result, until = self._verify(token, now)
        if len(self.cache) >= self.cache_size:
            self.cache.clear()
        self.cache[token] = (result, until)
        return result

    def _verify(self, token: bytes, now: float) -> tuple[dict[str, Any] | None, float]:
        """The claims, or None, and until when that answer holds."""
        leeway = self.settings.leeway
        try:
            claims = self._decode(token, leeway)
        except pyjwt.ImmatureSignatureError:  # the signature verified; `nbf` or `iat` is ahead
            not_before = max(leeway, NOT_BEFORE_LEEWAY)
            try:
                claims = self._decode(token, not_before)
            except pyjwt.ImmatureSignatureError:
                return None, max(now + 1.0, _valid_from(token) - not_before)
            except (pyjwt.PyJWTError, ValueError, TypeError):
                return None, FOREVER
        except (pyjwt.PyJWTError, ValueError, TypeError):
            return None, FOREVER
        exp = claims.get("exp")
        if exp is not None and (isinstance(exp, bool) or not isinstance(exp, int | float)):
            # PyJWT reads a numeric string ("1700000000") as the time it spells, but RFC 7519 4.1.4
            # asks for a number, and such a token would otherwise be cached as valid for ever
            return None, FOREVER
        if isinstance(exp, int | float):
            if exp + leeway <= now:
                return None, FOREVER  # expired: checked above only with the not-before leeway
            return claims, exp + leeway
        return claims, FOREVER

    def _decode(self, token: bytes, leeway: float) -> dict[str, Any]:
        s = self.settings
        options = {"require": [], "verify_aud": s.audience is not None}
        claims: dict[str, Any] = pyjwt.decode(
            token,
            key=self.key,
            algorithms=list(s.algorithms),
            audience=s.audience,
            issuer=s.issuer,
            leeway=leeway,
            options=options,  # type: ignore[arg-type]
        )
        return claims


def _valid_from(token: bytes) -> float:
    """The later of `nbf` and `iat` of a token whose signature has verified."""
    payload = pyjwt.decode(token, options={"verify_signature": False})
    times = [value for value in (payload.get("nbf"), payload.get("iat")) if isinstance(value, int | float)]
    return float(max(times, default=0))


class _Pairs:
    """Query parameters or cookies, read for identities. A name sent twice, or one that may be
    hidden past the first MAX_PAIRS, cannot be read as one value (the upstream might read another):
    asking for it is a 400, as for a repeated header. So is a value holding a separator that common
    upstream stacks split on where this parser does not (`ambiguous`): `;` in a query value (old
    CGI and servlet parsers), `,` in a cookie value (RFC 2965 parsers)."""

    def __init__(self, kind: str, pairs: Iterable[tuple[bytes, bytes]], ambiguous: bytes) -> None:
        self.kind = kind
        self.ambiguous = ambiguous
        self.found: dict[bytes, bytes] = {}
        self.repeated: set[bytes] = set()
        self.overflow = False
        for count, (name, value) in enumerate(pairs):
            if count == MAX_PAIRS:
                self.overflow = True
                break
            if name in self.found:
                self.repeated.add(name)
            else:
                self.found[name] = value

    def get(self, name: bytes) -> bytes | None:
        if name in self.repeated:
            raise BadRequest(f"{self.kind} {name.decode('latin-1')} is sent more than once")
        value = self.found.get(name)
        if value is None and self.overflow:
            raise BadRequest(f"more than {MAX_PAIRS} {self.kind}s: {name.decode('latin-1')} cannot be read")
        if value is not None and self.ambiguous in value:
            raise BadRequest(f"{self.kind} {name.decode('latin-1')} holds a {self.ambiguous.decode()!r}, "
                             "which upstreams split differently")
        return value


class RequestView:
    """What identity sources read from one request (`gateway.http.request.Request`, already
    stripped of hop-by-hop fields), computed once and only on demand."""

    __slots__ = ("_claims", "_claims_done", "_cookies", "_ip", "_query", "body_more", "body_prefix",
                 "config", "consumer", "jwt", "method", "params", "plan", "request")

    def __init__(
        self, request: Request, params: dict[str, str], config: Config, jwt: JwtVerifier | None
    ) -> None:
        self.request = request
        self.params = params
        self.config = config
        self.jwt = jwt
        self.body_prefix: bytes | None = None
        self.body_more = False  # more of the body follows body_prefix
        self._query: _Pairs | None = None
        self._cookies: _Pairs | None = None
        self._ip: str | None = None
        self._claims: dict[str, Any] | None = None
        self._claims_done = False
        self.plan: str | None = None  # the plan of the request's API key (`keys:`), once read
        self.consumer: str | None = None  # ... and its consumer (None: no registered key)
        self.method: str | None = None  # as the matched route's upstream acts on it (None: the request's own)

    def acted_method(self) -> str:
        """The method the matched route's upstream acts on (GET for HEAD; an override's, if honoured)."""
        return self.method or self.request.counted_method()

    def header(self, name: bytes) -> bytes | None:
        """One header's value; BadRequest if it came more than once."""
        return self.request.header(name)

    @property
    def ip(self) -> str:
        if self._ip is None:
            request = self.request
            self._ip = client_ip(request.peer, request.forwarded_for, self.config.trusted_proxies)
        return self._ip

    def query(self, name: bytes) -> bytes | None:
        if self._query is None:
            # as Starlette, FastAPI and aiohttp read them: percent-escapes as UTF-8, an invalid
            # sequence as U+FFFD (two invalid values are one key, as they are one value upstream)
            pairs = parse_qsl(self.request.query.decode("latin-1"), keep_blank_values=True)
            self._query = _Pairs("query parameter", (
                (k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape").strip(b" \t"))
                for k, v in pairs
            ), b";")
        return self._query.get(name)

    def cookie(self, name: bytes) -> bytes | None:
        if self._cookies is None:
            raw = self.header(b"cookie") or b""
            pieces = (piece.partition(b"=") for piece in raw.split(b";"))
            self._cookies = _Pairs("cookie", ((k.strip(_STR_SPACE), cookie_value(v)) for k, sep, v in pieces if sep),
                                   b",")
        return self._cookies.get(name)

    def claim(self, name: str) -> bytes | None:
        if not self._claims_done:
            self._claims_done = True
            if self.jwt is not None:
                self._claims = self.jwt.claims(self.header(self.jwt.settings.header.lower().encode()))
        if self._claims is None:
            return None
        value = self._claims.get(name)
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 42.0 in JSON is the number 42 to the upstream's reader
        return str(value).encode()

    def meets(self, route: Route) -> bool:
        """Whether this request is one `route.when` asks for: every header, claim and address it names.
        A header it names that came twice is a 400, as for an identity."""
        return self.meets_conditions(route.when)

    def meets_conditions(self, when: Conditions) -> bool:
        """Whether this request meets every header, claim, address and plan `when` names."""
        for name, values in when.headers:
            value = self.header(name)
            if value is None or (values is not None and value not in values):
                return False
        for claim, wanted in when.jwt:
            value = self.claim(claim)
            if value is None or value.decode() not in wanted:
                return False
        if when.client:
            try:
                address = ipaddress.ip_address(self.ip)
            except ValueError:
                return False
            if not any(address in network for network in when.client):
                return False
        return not when.plans or self.plan in when.plans

    def read(self, source: Source) -> bytes | None:
        value = self._read(source)
        if source.type is None or value is None:
            return value
        try:
            return canonical_bytes(source.type, value)
        except ValueError as exc:
            raise BadRequest(f"{source.kind}:{source.name} {exc}") from None

    def _read(self, source: Source) -> bytes | None:
        kind = source.kind
        if kind == "header":
            return self.header(source.name.lower().encode("latin-1"))
        if kind == "ip":
            return self.ip.encode()
        if kind == "path":
            value = self.params.get(source.name)
            return value.encode("utf-8", "surrogateescape") if value is not None else None
        if kind == "query":
            return self.query(source.name.encode("latin-1"))
        if kind == "cookie":
            return self.cookie(source.name.encode("latin-1"))
        if kind == "method":
            return self.acted_method().encode()
        if kind == "jwt":
            return self.claim(source.name)
        if kind == "consumer":
            return self.consumer.encode() if self.consumer is not None else None
        if kind == "body":
            if self.body_prefix is None:
                return None
            return body_identity(self.body_prefix, self.body_more, self.config.body_digest_max_bytes)
        raise AssertionError(kind)


def body_identity(prefix: bytes, more: bool, limit: int) -> bytes:
    """The identity of a request body by its bytes alone, whatever its framing (Content-Length or
    chunked): a digest of its first `limit` bytes and, when that is all of it, of its length.
    Bodies longer than `limit` that share their first `limit` bytes are one identity."""
    digest = hashlib.blake2b(prefix[:limit], digest_size=16)
    digest.update(b"|%d" % len(prefix) if len(prefix) <= limit and not more else b"|+")
    return digest.hexdigest().encode()


# What str.strip() removes from a field decoded as Latin-1, as Starlette decodes a Cookie field
# before stripping each name and value: NEL and NBSP, and the ASCII separators, too
_STR_SPACE = bytes(c for c in range(256) if chr(c).isspace())
_ESCAPE = re.compile(rb"\\(?:([0-3][0-7][0-7])|(.))", re.DOTALL)


def cookie_value(raw: bytes) -> bytes:
    """A cookie value as frameworks hand it to the application, every reader's decoding applied
    (a value two readers would decode apart is one key, never two): a quoted value unquoted with
    its backslash escapes decoded (\\c, and \\ooo octal: Python's http.cookies, which Starlette,
    aiohttp and Django use), then percent-escapes (Express, PHP), then trimmed of whatever
    whitespace any of them trims (Starlette's str.strip(): NBSP and NEL too)."""
    value = raw.strip(_STR_SPACE)
    if len(value) >= 2 and value[:1] == b'"' and value[-1:] == b'"':
        value = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]) if m.group(1) else m.group(2), value[1:-1])
    if b"%" in value:
        value = unquote_to_bytes(value)
    return value.strip(_STR_SPACE)


def rule_identity(rule: Rule, view: RequestView) -> tuple[bytes, ...] | None:
    """The rule's identity parts, or None when the rule is skipped for this request."""
    parts: list[bytes] = []
    limit = view.config.identity_max_bytes
    for source in rule.by:
        value = view.read(source)
        if not value:
            if rule.on_missing == "skip":
                return None
            if rule.on_missing == "ip":
                return (b"", view.ip.encode())  # an empty part: never equal to a real identity
            raise IdentityMissing(rule.name, str(source))
        if len(value) > limit:
            raise BadRequest(f"{source} is longer than {limit} bytes")
        parts.append(value)
    return tuple(parts)
