"""The canonical request (gateway.http.request.read_request and the identity readers): what a
limit counts is the value an upstream reads, so one client cannot present itself as many, nor one
resource as two (issue 17: V1 whitespace, V5 host, R4 separators)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import Config, RedisSettings, Source
from gateway.errors import BadRequest
from gateway.http.request import Request, read_request
from gateway.identity import RequestView


def _request(headers: list[tuple[bytes, bytes]], scheme: str = "http", query: bytes = b"") -> Request:
    scope: dict[str, Any] = {"headers": headers, "query_string": query, "client": ("10.0.0.2", 1234),
                             "method": "GET", "path": "/", "raw_path": b"/", "scheme": scheme}
    return read_request(scope)


def _read(headers: list[tuple[bytes, bytes]], source: Source, query: bytes = b"") -> bytes | None:
    request = _request([(b"host", b"gw"), *headers], query=query)
    return RequestView(request, {}, CONFIG, None).read(source)


CONFIG = Config(source="t", redis=RedisSettings(), trusted_proxies=(), upstreams={}, routes=())
whitespace = st.text(alphabet=" \t", max_size=3).map(str.encode)


@given(whitespace, whitespace)
def test_an_identity_field_is_its_value_without_surrounding_whitespace(before: bytes, after: bytes) -> None:
    value = _read([(b"x-user-id", before + b"alice" + after)], Source("header", "X-User-Id"))
    assert value == b"alice"


def test_trimmed_values_are_what_is_forwarded() -> None:
    request = _request([(b"host", b"gw "), (b"x-user-id", b"alice \t"), (b"accept", b"*/*")])
    assert request.headers == [(b"x-user-id", b"alice"), (b"accept", b"*/*")]
    assert request.host == b"gw" and request.trimmed
    assert not _request([(b"host", b"gw"), (b"accept", b"*/*")]).trimmed


@pytest.mark.parametrize(("sent", "scheme", "canonical"), [
    (b"A.Example", "http", b"a.example"),
    (b"a.example.", "http", b"a.example"),
    (b"a.example.:80", "http", b"a.example"),
    (b"a.example:443", "https", b"a.example"),
    (b"a.example:443", "http", b"a.example:443"),
    (b"[::1]:80", "http", b"[::1]"),
    (b"127.0.0.1:8080", "http", b"127.0.0.1:8080"),
])
def test_the_host_is_canonical(sent: bytes, scheme: str, canonical: bytes) -> None:
    request = _request([(b"host", sent)], scheme=scheme)
    assert request.host == canonical
    assert request.hostname == canonical.rsplit(b":", 1)[0].decode() if b"]" not in canonical else "[::1]"


@pytest.mark.parametrize("sent", [b"a..example", b".a.example", b"a%2eexample", b"a.example:99999", b"a.example:"])
def test_a_host_resolvers_may_read_two_ways_is_refused(sent: bytes) -> None:
    with pytest.raises(BadRequest):
        _request([(b"host", sent)])


@pytest.mark.parametrize(("query", "source"), [
    (b"id=Q;id=b", Source("query", "id")),        # `;` splits parameters for CGI and servlet parsers
    (b"id=Q%3Bid=b", Source("query", "id")),      # ... and once decoded
])
def test_a_query_value_holding_a_separator_is_refused(query: bytes, source: Source) -> None:
    with pytest.raises(BadRequest, match="upstreams split differently"):
        _read([], source, query=query)


def test_cookie_values_are_read_as_frameworks_read_them() -> None:
    sid = Source("cookie", "sid")
    assert _read([(b"cookie", b"sid=C%20")], sid) == b"C"
    assert _read([(b"cookie", b'sid="C"')], sid) == b"C"
    assert _read([(b"cookie", b"sid=%43")], sid) == b"C"
    assert _read([(b"cookie", b"a=1; sid=C")], sid) == b"C"
    with pytest.raises(BadRequest):  # RFC 2965 parsers split on `,`: two sids to them
        _read([(b"cookie", b"sid=C, sid=b")], sid)
    with pytest.raises(BadRequest):
        _read([(b"cookie", b"sid=C; sid=b")], sid)
    assert _read([(b"x-user", b"u")], sid) is None


@pytest.mark.parametrize("sent", [b"sid=decoy; sid =C", b"sid=decoy; \xa0sid=C", b"sid=decoy;sid\x85=C"])
def test_a_cookie_name_is_read_as_starlette_reads_it(sent: bytes) -> None:
    """Starlette strips each name, and the last of a name wins: `sid=decoy; sid =C` is C to the app.
    Before, the gateway read the name `sid ` apart and counted the decoy (an outside probe)."""
    with pytest.raises(BadRequest):
        _read([(b"cookie", sent)], Source("cookie", "sid"))


_space = st.text(alphabet=" \t\x0b\x0c\x1c\x1f\x85\xa0", max_size=2)
_pair = st.tuples(_space, st.sampled_from(["sid", "x", "si d"]), _space, _space,
                  st.text(alphabet='C%2"\\=,', max_size=4), _space)
cookie_text = st.lists(_pair, min_size=1, max_size=3).map(
    lambda pairs: ";".join(f"{a}{name}{b}={c}{value}{d}" for a, name, b, c, value, d in pairs))


@given(cookie_text)
def test_a_cookie_is_one_key_for_each_value_the_app_reads(text: str) -> None:
    """Differential, against Starlette's own cookie parser: whatever the spelling, what the gateway
    counts for `sid` is what it counts for the value the app reads, or the request is refused."""
    from starlette.requests import cookie_parser

    sid = Source("cookie", "sid")
    app = cookie_parser(text).get("sid")
    try:
        ours = _read([(b"cookie", text.encode("latin-1"))], sid)
    except BadRequest:
        return
    if app is None or app == "":
        assert not ours, (text, ours)
        return
    try:
        canonical = _read([(b"cookie", b"sid=" + app.encode("latin-1"))], sid)
    except BadRequest:
        return  # the app's value cannot be sent alone (it holds a separator): not one key to compare
    assert ours == canonical, (text, app, ours, canonical)
