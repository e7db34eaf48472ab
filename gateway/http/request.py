"""One inbound request, read once from the ASGI scope and checked before anything else happens.

`read_request(scope)` is the only place the gateway walks `scope["headers"]`. It refuses what an
upstream could read differently from the gateway:

- Content-Length together with Transfer-Encoding, or differing Content-Lengths: 400;
  a transfer-coding other than chunked: 501; CONNECT, or an Upgrade other than a WebSocket
  handshake (h2c, an Upgrade without `Connection: upgrade`, not a GET on HTTP/1.1): 501; a
  WebSocket handshake carrying a body: 400 (whether its route takes WebSocket is the pipeline's
  question, once the route is known);
- no Host on HTTP/1.1, more than one Host, or a Host that is not a host: 400;
- a head larger than `max_head_bytes`, whatever the server protocol buffered: 431;
- a target that is not a path, an encoded `/` or `\\` or control character (NUL, CR, LF, ...), a
  bad percent-escape, or a path that climbs above the root: 400.

What passes is the canonical request, the one both the limiter and the upstream read (RFC 9110
5.5): field values without leading or trailing whitespace (and forwarded so), headers named in
`Connection` and the hop-by-hop set removed *before* identities are read, X-Forwarded-For lines
joined into one list, the host lowercased without a trailing dot or its scheme's default port, and
the path normalized (unreserved escapes decoded, dot segments removed, slashes merged) into
`raw_path`, which is exactly what the upstream receives. Trailers never get here: the server
protocol drops them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

from gateway.errors import BadRequest, HeadTooLarge, NotImplementedRequest
from gateway.hop_by_hop import HOP_BY_HOP
from gateway.settings import DEFAULTS

# Written by the gateway itself when forwarding, never passed through as sent.
REWRITTEN = frozenset({
    b"host", b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-request-id",
    b"expect", b"content-length",
})
# Framing fields a Connection header may not remove: the gateway reads them itself.
_FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding"})
_NOT_FORWARDED = HOP_BY_HOP | REWRITTEN
_NONE: frozenset[bytes] = frozenset()
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Fields through which frameworks let a client name another method than the request line's (Express's
# method-override, Symfony, ASP.NET, Google's APIs): the method the upstream acts on, so the one counted
METHOD_OVERRIDES = (b"x-http-method-override", b"x-http-method", b"x-method-override")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}\Z")  # RFC 9110 5.6.2

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HOST = re.compile(rb"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+;=%-]*)(:[0-9]{1,5})?$")
_ESCAPE_CHECK = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_CONTROL_ESCAPE = re.compile(rb"%(?:[01][0-9A-Fa-f]|7[Ff])")
_SUSPECT = re.compile(rb"[%;\\]|/\.|//")  # what normalize_path has to decode, remove or refuse


@dataclass(slots=True)
class Request:
    """What the gateway acts on; built once per request by `read_request`."""

    method: str
    path: str                  # normalized and decoded: what routes match
    raw_path: bytes            # normalized, escapes other than unreserved kept: what the upstream gets
    query: bytes
    peer: str                  # the connected client's address
    scheme: str
    host: bytes | None         # the one Host value (None on HTTP/1.0 without one)
    forwarded_for: bytes | None  # every X-Forwarded-For line, joined in order
    content_length: int | None
    chunked: bool
    headers: list[tuple[bytes, bytes]]   # what is forwarded as sent (end-to-end, not rewritten)
    first: dict[bytes, bytes]            # end-to-end fields by lowercase name: the first value
    repeated: frozenset[bytes]           # end-to-end fields that came more than once
    request_id: bytes | None = None      # X-Request-Id as sent
    dropped: frozenset[bytes] = frozenset()    # end-to-end fields named in Connection (removed)
    underscored: frozenset[bytes] = frozenset()  # names sent with `_`, spelled with `-`
    trimmed: bool = False                # some field value came with whitespace around it
    upgrade: bool = False                # a WebSocket handshake (Upgrade: websocket, no body)
    override: str | None = None          # the method a method-override field names, upper case
    body_rewritten: bool = False         # the gateway changed the body (a token budget's stream_options)

    def counted_method(self, honour_override: bool = True) -> str:
        """The method the upstream acts on: the override's where the route's upstream honours one,
        and GET for HEAD (RFC 9110 9.3.2: GET without the body, served by the GET handler)."""
        method = self.override if honour_override and self.override is not None else self.method
        return "GET" if method == "HEAD" else method

    @property
    def hostname(self) -> str:
        """The host without its port ("" when none): what `match.host` compares."""
        if not self.host:
            return ""
        text = self.host.decode("latin-1")
        if text.startswith("["):
            return text.split("]")[0] + "]"
        return text.rsplit(":", 1)[0] if ":" in text else text

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    def header(self, name: bytes) -> bytes | None:
        """The one value of an end-to-end field; a field sent more than once cannot be read as
        one value, so asking for it is a 400 (the limit and the upstream could disagree)."""
        if name in self.repeated or name in self.underscored:
            # X-User-Id and X-User_Id are one name to a CGI-style upstream (HTTP_X_USER_ID)
            raise BadRequest(f"header {name.decode('latin-1')} is sent more than once")
        if name == b"host":
            return self.host
        if name == b"x-forwarded-for":
            return self.forwarded_for
        if name == b"x-request-id":
            return self.request_id
        return self.first.get(name)


class Original(Protocol):
    """How a request names another one, the request the check port is asked about (gateway/check.py):
    the fields that name it, taken out of the headers, and what they say."""

    fields: frozenset[bytes]  # lowercase names; a value each, trimmed (a field sent twice is a 400)

    def spelled(self, name: bytes) -> str:
        """A field's name as the docs spell it."""
        ...

    def read(self, named: dict[bytes, bytes], scope: MutableMapping[str, Any]) -> tuple[str, bytes, bytes | None, str]:
        """The original's method, request target (origin-form, its query too), Host (None: the
        request's own) and scheme. Raises BadRequest when its fields cannot say."""
        ...


def read_request(scope: MutableMapping[str, Any], max_head_bytes: int = DEFAULTS.max_head_bytes,
                 original: Original | None = None) -> Request:
    """The checked view of one ASGI http scope. Raises BadRequest (400), HeadTooLarge (431) or
    NotImplementedRequest (501); nothing has been forwarded or counted when it does.

    `original`: the scope asks about another request (the check port), which is what is read: its
    method, target, Host and scheme as `original` reads them from its fields, which are not headers
    of it, and neither is the asking request's body framing (the original's body never comes)."""
    method: str = scope["method"]
    raw_target: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    query: bytes = scope.get("query_string") or b""
    scheme = scope.get("scheme", "http")
    size = len(method) + len(raw_target) + len(query) + 12
    special, naming_fields = _NOT_FORWARDED, _NONE
    if original is not None:
        special, naming_fields = _not_forwarded_nor(original.fields), original.fields
    naming: dict[bytes, bytes] = {}  # `original`'s fields
    headers: list[tuple[bytes, bytes]] = []
    first: dict[bytes, bytes] = {}
    repeated: set[bytes] = set()
    hosts: list[bytes] = []
    lengths: list[bytes] = []
    codings: list[bytes] = []
    forwarded: list[bytes] = []
    connection: list[bytes] = []
    request_id: bytes | None = None
    upgrades: list[bytes] = []
    trimmed = False
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
        stripped = value.strip(b" \t")  # llhttp keeps trailing whitespace; h11 and most apps do not
        if stripped is not value:
            value = stripped
            trimmed = True
        if name in special:
            if name in naming_fields:
                if name in naming:
                    assert original is not None
                    raise BadRequest(f"{original.spelled(name)} is sent more than once")
                naming[name] = value
            elif name == b"host":
                hosts.append(value)
            elif name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                codings.append(value)
            elif name == b"x-forwarded-for":
                forwarded.append(value)
            elif name == b"connection":
                connection.append(value)
            elif name == b"upgrade":
                upgrades.append(value)
            elif name == b"x-request-id":
                if request_id is None:
                    request_id = value
                else:
                    repeated.add(name)  # no identity reads it as one value
            continue
        if name in first:
            repeated.add(name)
        else:
            first[name] = value
        headers.append((name, value))
    if original is not None:
        method, target, host_named, scheme = original.read(naming, scope)
        raw_target, _, query = target.partition(b"?")
        lengths, codings = [], []
        if host_named is not None:
            hosts = [host_named]
    if method == "CONNECT":
        raise NotImplementedRequest("CONNECT is not supported")
    if size > max_head_bytes:
        raise HeadTooLarge(f"request line and headers exceed {max_head_bytes // 1024} KiB")

    dropped: set[bytes] = set()
    connection_upgrade = False
    if connection:
        named = {t.strip().lower() for v in connection for t in v.split(b",")} - {b""}
        connection_upgrade = b"upgrade" in named
        dropped = named - _FRAMING
        if b"x-forwarded-for" in dropped:
            forwarded = []
        if dropped & first.keys():
            headers = [(n, v) for n, v in headers if n not in dropped]
            first = {n: v for n, v in first.items() if n not in dropped}
            repeated -= dropped
    websocket = False
    if upgrades or connection_upgrade:
        # RFC 6455 4.1: a GET on HTTP/1.1, `Upgrade: websocket` named in `Connection`. Anything else
        # (h2c, a second Upgrade line, an Upgrade the Connection field does not name) is refused:
        # the upstream could switch where the gateway would not
        websocket = (connection_upgrade and len(upgrades) == 1 and upgrades[0].lower() == b"websocket"
                     and method == "GET" and scope.get("http_version", "1.1") == "1.1")
        if not websocket:
            raise NotImplementedRequest("protocol upgrades other than WebSocket (h2c, ...) are not supported")

    chunked = False
    if codings:
        if lengths:
            raise BadRequest("a request may not carry both Content-Length and Transfer-Encoding")
        coding = b",".join(codings).strip().lower()
        if coding != b"chunked":
            raise NotImplementedRequest(
                f"transfer-coding {coding[:64].decode('latin-1')!r} is not supported (only chunked)"
            )
        chunked = True
    content_length = None
    if lengths:
        if len(set(lengths)) > 1:
            raise BadRequest("the request carries differing Content-Length values")
        text = lengths[0]  # trimmed with every field value
        if not text.isdigit() or len(text) > 18:
            raise BadRequest("Content-Length is not a number")
        content_length = int(text)
    if websocket and (chunked or content_length):
        # after a 101 the bytes that follow the head are the tunnel's: a body would be read as
        # frames by one side and as a request body by the other
        raise BadRequest("a WebSocket handshake carries no body")

    host = None
    if len(hosts) > 1:
        raise BadRequest("the request carries more than one Host")
    if hosts:
        host = canonical_host(hosts[0], scheme)
    elif scope.get("http_version", "1.1") != "1.0":
        raise BadRequest("an HTTP/1.1 request must carry a Host header")

    # one search of all the names: `bytes in bytes` costs ~150 ns a time on CPython 3.11
    underscored = frozenset(n.replace(b"_", b"-") for n in first if b"_" in n) if b"_" in b"".join(first) else _NONE
    override = None
    if not first.keys().isdisjoint(METHOD_OVERRIDES) or not underscored.isdisjoint(METHOD_OVERRIDES):
        override = _override(first, repeated)
    raw_path = normalize_path(raw_target)
    try:
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path, errors="strict")
    except UnicodeError:
        raise BadRequest("the path is not valid UTF-8 once decoded") from None
    client = scope.get("client")
    return Request(
        method=method,
        path=path,
        raw_path=raw_path,
        query=query,
        peer=client[0] if client else "0.0.0.0",
        scheme=scheme,
        host=host,
        forwarded_for=b", ".join(forwarded) if forwarded else None,
        content_length=content_length,
        chunked=chunked,
        headers=headers,
        first=first,
        repeated=frozenset(repeated) if repeated else _NONE,
        request_id=request_id,
        dropped=frozenset(dropped) if dropped else _NONE,
        underscored=underscored,
        trimmed=trimmed,
        upgrade=websocket,
        override=override,
    )


@functools.lru_cache(maxsize=16)
def _not_forwarded_nor(fields: frozenset[bytes]) -> frozenset[bytes]:
    return _NOT_FORWARDED | fields


def _override(first: dict[bytes, bytes], repeated: set[bytes]) -> str | None:
    """The method the request's method-override fields name; 400 when they cannot be read as one
    method (sent twice, naming different methods, or not a method at all)."""
    named: set[str] = set()
    spelled = [(sent, value) for sent, value in first.items() if sent.replace(b"_", b"-") in METHOD_OVERRIDES]
    if len(spelled) != len({sent.replace(b"_", b"-") for sent, _ in spelled}):
        raise BadRequest("a method-override header is sent more than once")  # X-HTTP-Method and X_HTTP_Method
    for name, value in spelled:
        if name in repeated:
            raise BadRequest(f"header {name.decode()} is sent more than once")
        if b"_" in name:  # a CGI-style upstream reads it as the override, Starlette and aiohttp do not
            raise BadRequest(f"header {name.decode()} is an override to some upstreams and not to others")
        text = value.decode("latin-1").upper()  # as Express, Symfony and ASP.NET read it
        if _TOKEN.match(text) is None:
            raise BadRequest(f"header {name.decode()} does not name a method")
        named.add(text)
    if len(named) > 1:
        raise BadRequest("the method-override headers name different methods: " + ", ".join(sorted(named)))
    return named.pop() if named else None


def canonical_host(value: bytes, scheme: str) -> bytes:
    """The authority as every upstream and resolver reads it: lowercase, the DNS root's trailing
    dot dropped, no port when it is the scheme's default. 400 for what is not a host, and for what
    resolvers may read two ways (an empty label, a percent-escape). A host of a length any name has
    is remembered: a gateway's requests carry a handful of hosts (a refusal is never remembered)."""
    if len(value) <= _REMEMBERED_HOST:
        return _remembered_host(value, scheme)
    return _canonical_host(value, scheme)


_REMEMBERED_HOST = 262  # a DNS name's 253 bytes, a port and brackets


@functools.lru_cache(maxsize=1024)
def _remembered_host(value: bytes, scheme: str) -> bytes:
    return _canonical_host(value, scheme)


def _canonical_host(value: bytes, scheme: str) -> bytes:
    if not _HOST.match(value):
        raise BadRequest("the Host header is not a host")
    host, port = value.lower(), b""
    if not host.startswith(b"["):
        host, _, port = host.partition(b":")
        if b"%" in host:
            raise BadRequest("a percent-escape in the Host is ambiguous")
        if host.endswith(b"."):
            host = host[:-1]  # a.example. and a.example are one name
        if host.startswith(b".") or b".." in host:
            raise BadRequest("the Host header is not a host")
    else:
        host, _, port = host.partition(b"]:")
        host = host.rstrip(b"]") + b"]"
    if port and int(port) > 65535:
        raise BadRequest("the Host header's port is out of range")
    if port and int(port) == _DEFAULT_PORTS.get(scheme):
        port = b""
    return host + b":" + port if port else host


def normalize_path(raw: bytes) -> bytes:
    """RFC 3986 normalization of an origin-form path, strict about what could be read two ways:
    escapes of unreserved characters decoded, dot segments removed, runs of `/` merged. An
    encoded `/` or `\\` or control character, a literal `\\`, a malformed escape, or `..` above the
    root is a 400."""
    if raw.startswith(b"/") and not _SUSPECT.search(raw):
        return raw  # nothing to normalize or refuse: the common case, in one search
    if not raw.startswith(b"/"):
        raise BadRequest("the request target must be a path starting with /")
    if b";" in raw:
        # servlet containers read `;params` and `..;` as path parameters: refused, as Spring's
        # StrictHttpFirewall does, so no upstream can serve another path than the one matched
        raise BadRequest("a ';' in the path is ambiguous")
    if b"\\" in raw:
        raise BadRequest("a backslash in the path is ambiguous")
    if b"%" in raw:
        if _ESCAPE_CHECK.search(raw):
            raise BadRequest("the path has a malformed percent-escape")
        raw = _ESCAPE.sub(_decode_unreserved, raw)
        if _CONTROL_ESCAPE.search(raw):
            # CR, LF, NUL and the rest: a path is never a place for them, and an upstream that
            # logs it or echoes it into a header (a Location) would read a line break (as Spring's
            # StrictHttpFirewall refuses them)
            raise BadRequest("an encoded control character (NUL, TAB, CR, LF, ...) in the path is refused")
        lowered = raw.lower()
        if b"%2f" in lowered or b"%5c" in lowered or b"%3b" in lowered:
            raise BadRequest("an encoded '/', '\\' or ';' in the path is ambiguous")
    segments = raw.split(b"/")[1:]
    out: list[bytes] = []
    for segment in segments:
        if segment == b"..":
            if not out:
                raise BadRequest("the path climbs above the root")
            out.pop()
        elif segment and segment != b".":
            out.append(segment)
    trailing = segments[-1] in (b"", b".", b"..")
    path = b"/" + b"/".join(out)
    if trailing and out:
        path += b"/"
    return path


def _decode_unreserved(match: re.Match[bytes]) -> bytes:
    byte = int(match.group(1), 16)
    return bytes((byte,)) if byte in _UNRESERVED else b"%" + match.group(1).upper()
