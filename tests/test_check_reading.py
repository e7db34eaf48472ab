"""The check port reads the request it is asked about in the one pass read_request makes over the
asking request's headers (gateway/check.py `Asked`): whatever the request, it must read exactly the
`Request` the proxy port reads when that request comes to it directly, or refuse it alike (the same
status and words). The asking request's own framing and the convention's fields are not the
original's, and a convention field sent twice is a 400."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.check import Asked
from gateway.errors import BadRequest
from gateway.http.request import Request, read_request

METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "PROPFIND"])
SEGMENTS = st.sampled_from(["api", "items", "42", "%41b", "%2f", "..", ".", "", ";x", "%zz", "caf%C3%A9", "%00"])
PATHS = st.lists(SEGMENTS, min_size=0, max_size=5).map(lambda parts: ("/" + "/".join(parts)).encode())
QUERIES = st.sampled_from([b"", b"a=1", b"a=1&b=%20", b"x"])
NAMES = st.sampled_from([b"x-user-id", b"x_user_id", b"x-api-key", b"x-forwarded-for", b"cookie", b"connection",
                         b"x-http-method-override", b"x-request-id", b"keep-alive", b"accept"])
VALUES = st.sampled_from([b"alice", b" alice ", b"\tbob", b"1.2.3.4", b"keep-alive, x-api-key", b"DELETE",
                          b"get", b"a=1; b=2", b""])
HEADERS = st.lists(st.tuples(NAMES, VALUES), max_size=6)
HOSTS = st.sampled_from([b"shop.example", b"Shop.Example.:80", b"shop.example:8443", b"[::1]:80", b"bad host",
                         b"a..b"])


def _scope(method: str, raw_path: bytes, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "http_version": "1.1", "scheme": "http", "method": method, "path": raw_path.decode(),
            "raw_path": raw_path, "query_string": query, "headers": headers, "client": ("10.0.0.7", 5000),
            "server": ("127.0.0.1", 8081)}


def _read(scope: dict[str, Any], original: Asked | None = None) -> Request | tuple[type, str, int]:
    try:
        return read_request(scope, original=original)
    except BadRequest as exc:  # NotImplementedRequest and HeadTooLarge too
        return type(exc), str(exc), exc.status


def _as_proxied(method: str, path: bytes, query: bytes, host: bytes,
                headers: list[tuple[bytes, bytes]]) -> Request | tuple[type, str, int]:
    return _read(_scope(method, path, query, [(b"host", host), *headers]))


def _target(path: bytes, query: bytes) -> bytes:
    return path + b"?" + query if query else path


@settings(max_examples=400, deadline=None)
@given(METHODS, PATHS, QUERIES, HOSTS, HEADERS, st.booleans())
def test_traefik_and_caddys_fields_read_what_the_proxy_port_reads(
        method: str, path: bytes, query: bytes, host: bytes, headers: list[tuple[bytes, bytes]],
        framed: bool) -> None:
    asking = [(b"host", b"gateway:8081"), *headers, (b"x-forwarded-method", method.encode()),
              (b"x-forwarded-uri", _target(path, query)), (b"x-forwarded-host", host),
              (b"x-forwarded-proto", b"http")]
    if framed:  # the asking request's own body framing is not the original's
        asking += [(b"content-length", b"5"), (b"transfer-encoding", b"gzip")]
    assert _read(_scope("GET", b"/", b"", asking), Asked()) == _as_proxied(method, path, query, host, headers)


@settings(max_examples=400, deadline=None)
@given(METHODS, PATHS, QUERIES, HOSTS, HEADERS)
def test_nginxs_fields_read_what_the_proxy_port_reads(
        method: str, path: bytes, query: bytes, host: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    asking = [(b"host", host), *headers, (b"x-original-method", method.encode()),
              (b"x-original-uri", _target(path, query))]
    assert _read(_scope("GET", b"/auth", b"", asking), Asked()) == _as_proxied(method, path, query, host, headers)


@settings(max_examples=200, deadline=None)
@given(METHODS, PATHS, QUERIES, HOSTS, HEADERS)
def test_envoys_request_line_reads_what_the_proxy_port_reads(
        method: str, path: bytes, query: bytes, host: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    asking = _scope(method, b"/check" + path, query, [(b"host", host), *headers])
    assert _read(asking, Asked("/check", "request_line")) == _as_proxied(method, path, query, host, headers)


@pytest.mark.parametrize("field", [b"x-forwarded-uri", b"x-forwarded-method", b"x-original-url"])
def test_a_convention_field_sent_twice_is_a_400_whichever_convention_is_read(field: bytes) -> None:
    asking = [(b"host", b"shop.example"), (b"x-forwarded-method", b"GET"), (b"x-forwarded-uri", b"/a"),
              (field, b"/b"), (field, b"/c")]
    if field == b"x-forwarded-uri":
        del asking[2]
    found = _read(_scope("GET", b"/", b"", asking), Asked())
    assert isinstance(found, tuple) and found[2] == 400 and "more than once" in found[1], found


def test_the_fields_are_not_headers_of_the_request_read() -> None:
    asking = [(b"host", b"gw"), (b"x-forwarded-method", b"POST"), (b"x-forwarded-uri", b"/shop/1?x=1"),
              (b"x-forwarded-host", b"shop.example"), (b"x-original-method", b"DELETE"), (b"x-user-id", b"u")]
    asked = Asked()
    request = read_request(_scope("GET", b"/", b"", asking), original=asked)
    assert (request.method, request.path, request.query, request.host) == ("POST", "/shop/1", b"x=1", b"shop.example")
    assert request.headers == [(b"x-user-id", b"u")]
    assert asked.logged({"client": ("10.0.0.7", 1)}) == {"method": "POST", "path": "/shop/1", "client": ("10.0.0.7", 1)}
