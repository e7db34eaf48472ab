"""Client -> gateway: what a hostile or sloppy client sends, the status it gets, and the exact
bytes the upstream receives (SPEC section 4; RFC 9112 sections 2-7, RFC 9110 field rules).

Each case is sent on a fresh raw connection. Then a sentinel request on another connection acts as
a barrier: everything the case caused has reached the logging upstream before the sentinel does,
so "nothing was forwarded" is checked exactly, not by waiting.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest

from tests.conformance.conftest import Deployed
from tests.conformance.upstream import LoggingUpstream, Received
from tests.support.raw_http import Conn


def fwd(method: str, target: str, *fields: str, body: bytes = b"", length: bool = True) -> bytes:
    """The exact request the gateway must send upstream: its own Host first, the client's
    end-to-end fields in order, then X-Forwarded-*, X-Request-Id and the framing it writes."""
    lines = [f"{method} {target} HTTP/1.1", "host: {up}", *fields, "x-forwarded-for: 127.0.0.1",
             "x-forwarded-proto: http", "x-forwarded-host: gw", "x-request-id: rid"]
    if body and length:
        lines.append(f"content-length: {len(body)}")
    elif body:
        lines.append("transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def req(method: str, target: str, *fields: str, body: bytes = b"", host: bool = True) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", *(["Host: gw"] if host else []), "X-Request-Id: rid", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass(frozen=True)
class Case:
    id: str
    send: bytes
    status: int
    forwarded: tuple[bytes, ...] = ()   # exact bytes the upstream receives, in order
    also: tuple[int, ...] = ()          # statuses of pipelined requests after the first
    # under uvicorn's own protocol, where it answers otherwise: (status, forwarded); asserted as exactly
    uvicorn: tuple[int, tuple[bytes, ...]] | None = None


def elsewhere(raw: bytes, host: bytes = b"elsewhere") -> bytes:
    """`fwd(...)` for a request whose host is the absolute-form target's authority."""
    return raw.replace(b"x-forwarded-host: gw", b"x-forwarded-host: " + host)


def chunked(target: str, body: bytes) -> bytes:
    return req("POST", target, "Transfer-Encoding: chunked", body=body)


SMUGGLED = b"GET /open/admin/secret HTTP/1.1\r\nHost: gw\r\n\r\n"
BIG = "X-Big: " + "a" * 100_000

CASES = [
    # --- framing: refused before one byte goes upstream -----------------------------------------
    Case("upgrade-h2c-with-body", req("POST", "/open/early", "Connection: Upgrade, HTTP2-Settings",
         "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__", f"Content-Length: {len(SMUGGLED)}",
         body=SMUGGLED), 501),
    Case("upgrade-websocket", req("GET", "/open/ws", "Connection: Upgrade", "Upgrade: websocket",
         "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="), 501),
    Case("upgrade-header-alone", req("GET", "/open/u", "Upgrade: h2c"), 501),
    Case("cl-and-te", req("POST", "/open/clte", "Content-Length: 6", "Transfer-Encoding: chunked",
         body=b"0\r\n\r\n" + SMUGGLED), 400),
    Case("te-and-cl", req("POST", "/open/tecl", "Transfer-Encoding: chunked", "Content-Length: 3",
         body=b"8\r\nSMUGGLED\r\n0\r\n\r\n"), 400),
    Case("two-content-lengths", req("POST", "/open/cl2", "Content-Length: 5", "Content-Length: 6",
         body=b"hello!"), 400),
    Case("te-gzip-chunked", req("POST", "/open/gz", "Transfer-Encoding: gzip, chunked",
         body=b"5\r\nhello\r\n0\r\n\r\n"), 501),
    Case("te-chunked-twice", req("POST", "/open/cc", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked",
         body=b"5\r\nhello\r\n0\r\n\r\n"), 400),  # chunked applied twice: invalid (RFC 9112 6.1)
    Case("te-gzip-alone", req("POST", "/open/g", "Transfer-Encoding: gzip", body=b"hello"), 501,
         uvicorn=(400, ())),  # llhttp's refusal (its length is unknown), answered by uvicorn as it comes
    Case("te-gzip-then-chunked-lines", req("POST", "/open/g2", "Transfer-Encoding: gzip", "Transfer-Encoding: chunked",
         body=b"5\r\nhello\r\n0\r\n\r\n"), 501),
    Case("te-identity", req("POST", "/open/id", "Transfer-Encoding: identity", body=b"hello"), 501,
         uvicorn=(400, ())),
    # chunked not last: the length cannot be known, a 400 (RFC 9112 6.3); llhttp refuses the field as
    # it reads it, before the gateway sees which coding it names
    Case("te-chunked-then-gzip", req("POST", "/open/cg", "Transfer-Encoding: chunked, gzip", body=b"hello"), 400),
    Case("te-with-space-before-colon", req("POST", "/open/sp", "Transfer-Encoding : chunked",
         body=b"0\r\n\r\n"), 400),
    Case("two-hosts", req("GET", "/open/h", "Host: evil"), 400),
    Case("no-host", req("GET", "/open/nohost", host=False), 400),
    Case("host-not-a-host", req("GET", "/open/h", host=False) .replace(b"X-Request-Id", b"Host: a b\r\nX-Request-Id"),
         400),
    Case("head-over-64k-one-write", req("GET", "/open/big", BIG), 431),
    Case("obs-fold", req("GET", "/open/fold", "X-A: a", " folded"), 400),
    Case("nul-in-field", req("GET", "/open/nul", "X-A: a\x00b"), 400),
    Case("http2-prior-knowledge", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    # --- versions and target forms a 1.1 proxy cannot honour (RFC 9110 15.6.6; RFC 9112 3.2) ---------
    Case("version-2.0", b"GET /open/v20 HTTP/2.0\r\nHost: gw\r\nX-Request-Id: rid\r\n\r\n", 505),
    Case("version-0.9", b"GET /open/v09 HTTP/0.9\r\nHost: gw\r\nX-Request-Id: rid\r\n\r\n", 505),
    Case("absolute-form-ftp", req("GET", "ftp://elsewhere/open/ftp"), 400),
    Case("absolute-form-other-scheme", req("GET", "gopher://elsewhere/open/g"), 400),
    Case("absolute-form-scheme-any-case", req("GET", "HTTP://elsewhere/open/uc"), 200,
         (elsewhere(fwd("GET", "/open/uc")),), uvicorn=(200, (fwd("GET", "/open/uc"),))),
    # --- a head is bounded by its field count too: 100 fields, as Kestrel's and Envoy's defaults ---
    Case("fields-100", req("GET", "/open/f100", *["X-F: 1"] * 98), 200, (fwd("GET", "/open/f100", *["x-f: 1"] * 98),)),
    Case("fields-101", req("GET", "/open/f101", *["X-F: 1"] * 99), 431),
    Case("fields-13000-empty", req("GET", "/open/f13k", *["a:"] * 13_000), 431),
    Case("connect", b"CONNECT gw:443 HTTP/1.1\r\nHost: gw:443\r\nX-Request-Id: rid\r\n\r\n", 501,
         uvicorn=(400, ())),  # uvicorn's protocol cannot parse an authority-form target
    # --- RFC 9112 sections 2, 6, 7: line endings, lengths, chunks -----------------------------------
    Case("bare-lf-head", b"GET /open/lf HTTP/1.1\nHost: gw\nX-Request-Id: rid\n\n", 400),
    Case("bare-lf-one-field", b"GET /open/lf HTTP/1.1\r\nHost: gw\nX-Request-Id: rid\r\n\r\n", 400),
    Case("bare-lf-chunk-framing", chunked("/open/lfc", b"5\nhello\n0\n\n"), 400),
    Case("length-list-same", req("POST", "/open/l", "Content-Length: 5, 5", body=b"hello"), 400),
    Case("length-plus-sign", req("POST", "/open/l", "Content-Length: +5", body=b"hello"), 400),
    Case("length-negative", req("POST", "/open/l", "Content-Length: -1", body=b"hello"), 400),
    Case("length-overflow", req("POST", "/open/l", "Content-Length: 99999999999999999999", body=b"hello"), 400),
    Case("length-leading-zero", req("POST", "/open/l0", "Content-Length: 05", body=b"hello"), 200,
         (fwd("POST", "/open/l0", body=b"hello"),)),  # 5, and the gateway writes it as 5
    Case("chunk-size-not-hex", chunked("/open/zz", b"zz\r\nhello\r\n0\r\n\r\n"), 400),
    Case("chunk-size-space", chunked("/open/sp", b"5 \r\nhello\r\n0\r\n\r\n"), 400),
    Case("chunk-size-overflow", chunked("/open/of", b"ffffffffffffffffff\r\nhello\r\n0\r\n\r\n"), 400),
    Case("chunk-extension-dropped", chunked("/open/ext", b"5;ext=1\r\nhello\r\n0;last\r\n\r\n"), 200,
         (fwd("POST", "/open/ext", body=b"5\r\nhello\r\n0\r\n\r\n", length=False),)),
    Case("chunk-longer-than-size", chunked("/open/cl", b"3\r\nhello\r\n0\r\n\r\n"), 400),
    Case("close-then-pipelined", req("GET", "/open/first", "Connection: close") + req("GET", "/open/second"),
         200, (fwd("GET", "/open/first"),)),  # the bytes after a Connection: close are never a request
    Case("http10-then-pipelined", b"GET /open/old1 HTTP/1.0\r\nX-Request-Id: rid\r\n\r\n" + req("GET", "/open/old2"),
         200, (fwd("GET", "/open/old1").replace(b"x-forwarded-host: gw\r\n", b""),)),
    # --- paths: the normalized path is matched, and it is what the upstream gets -------------------
    Case("dot-dot-out-of-route", req("GET", "/open/../admin/a"), 404),
    Case("encoded-dot-dot", req("GET", "/open/%2e%2e/admin/a"), 404),
    Case("encoded-slash", req("GET", "/open/x/..%2fadmin/a"), 400),
    Case("encoded-backslash", req("GET", "/open/a%5Cb"), 400),
    Case("encoded-nul", req("GET", "/open/a%00b"), 400),
    Case("encoded-newline", req("GET", "/open/a%0D%0Ab"), 400),  # never a line break in an upstream's log or Location
    Case("bad-escape", req("GET", "/open/a%zzb"), 400),
    Case("above-root", req("GET", "/open/../../a"), 400),
    Case("semicolon-dot-dot", req("GET", "/open/x/..;/admin/c"), 400),   # servlets read `..;` as `..`
    Case("semicolon-params", req("GET", "/open;/e"), 400),
    Case("encoded-semicolon", req("GET", "/open/%2e%2e%3B/e"), 400),
    Case("double-slash", req("GET", "//open//a"), 200, (fwd("GET", "/open/a"),)),
    Case("dot-segment", req("GET", "/open/./a/."), 200, (fwd("GET", "/open/a/"),)),
    Case("unreserved-escape", req("GET", "/%6Fpen/%7Euser?q=%2e"), 200, (fwd("GET", "/open/~user?q=%2e"),)),
    Case("other-escapes-kept", req("GET", "/open/a%20b%3f"), 200, (fwd("GET", "/open/a%20b%3F"),)),
    # absolute-form: the target's authority is the host, as RFC 9112 3.2.2 and nginx's $host say; the
    # route, the limit and X-Forwarded-Host all read it. uvicorn's protocol keeps the Host field
    # instead: otherwise, but the limit and the upstream still agree.
    Case("absolute-form", req("GET", "http://elsewhere/open/abs"), 200, (elsewhere(fwd("GET", "/open/abs")),),
         uvicorn=(200, (fwd("GET", "/open/abs"),))),
    Case("absolute-form-routes-by-authority", req("GET", "http://elsewhere/hosted/a"), 200,
         (elsewhere(fwd("GET", "/hosted/a")),), uvicorn=(404, ())),
    Case("absolute-form-host-field-ignored", req("GET", "http://gw/hosted/a").replace(b"Host: gw", b"Host: elsewhere"),
         404, uvicorn=(200, (elsewhere(fwd("GET", "/hosted/a")),))),
    Case("absolute-form-port", req("GET", "http://elsewhere:8080/open/p"), 200,
         (elsewhere(fwd("GET", "/open/p"), b"elsewhere:8080"),), uvicorn=(200, (fwd("GET", "/open/p"),))),
    Case("absolute-form-userinfo", req("GET", "http://u@elsewhere/open/u"), 400,
         uvicorn=(200, (fwd("GET", "/open/u"),))),
    Case("absolute-form-no-host-field", req("GET", "http://elsewhere/open/nh", host=False), 400),
    Case("absolute-form-http10", b"GET http://elsewhere/hosted/old HTTP/1.0\r\nX-Request-Id: rid\r\n\r\n", 200,
         (elsewhere(fwd("GET", "/hosted/old")),), uvicorn=(404, ())),
    Case("absolute-form-two-host-fields", req("GET", "http://elsewhere/open/h2", "Host: other"), 400),
    # --- the limit and the upstream see the same request -------------------------------------------
    Case("connection-names-identity", req("GET", "/user/a", "X-User-Id: alice", "Connection: close, X-User-Id"),
         400),
    Case("identity-header-twice", req("GET", "/user/a", "X-User-Id: alice", "X-User-Id: bob"), 400),
    Case("identity-underscore-twin", req("GET", "/user/a", "X-User-Id: alice", "X-User_Id: bob"), 400),
    Case("identity-underscore-only", req("GET", "/user/a", "X-User_Id: bob"), 400),
    Case("identity-forwarded-once", req("GET", "/user/a", "X-User-Id: alice", "X-Other: 1", "X-Other: 2"), 200,
         (fwd("GET", "/user/a", "x-user-id: alice", "x-other: 1", "x-other: 2"),)),
    Case("trailer-is-not-an-identity", req("POST", "/user/t", "Transfer-Encoding: chunked",
         body=b"5\r\nhello\r\n0\r\nX-User-Id: victim\r\n\r\n"), 400),
    Case("trailer-never-forwarded", req("POST", "/user/t", "X-User-Id: alice", "Transfer-Encoding: chunked",
         body=b"5\r\nhello\r\n0\r\nX-User-Id: victim\r\nX-Evil: 1\r\n\r\n"), 200,
         (fwd("POST", "/user/t", "x-user-id: alice", body=b"5\r\nhello\r\n0\r\n\r\n", length=False),)),
    Case("xff-lines-joined", req("GET", "/open/x", "X-Forwarded-For: 1.1.1.1", "X-Forwarded-For: 2.2.2.2, 3.3.3.3"),
         200, (fwd("GET", "/open/x").replace(b"x-forwarded-for: 127.0.0.1",
                                             b"x-forwarded-for: 1.1.1.1, 2.2.2.2, 3.3.3.3, 127.0.0.1"),)),
    Case("hop-by-hop-dropped", req("GET", "/open/hop", "Keep-Alive: timeout=5", "TE: trailers", "X-Keep: 1",
         "Proxy-Connection: keep-alive", "Connection: X-Drop", "X-Drop: 1"), 200,
         (fwd("GET", "/open/hop", "x-keep: 1"),)),
    Case("body-framed-by-gateway", req("POST", "/open/b", "Content-Length: 5", body=b"hello"), 200,
         (fwd("POST", "/open/b", body=b"hello"),)),
    Case("pipelined-then-malformed", req("GET", "/open/pm1") + req("POST", "/open/pm2", "Content-Length: 5",
         "Transfer-Encoding: chunked", body=b"0\r\n\r\n"), 200, (fwd("GET", "/open/pm1"),), also=(400,)),
    Case("pipelined-exactly-once-each", req("GET", "/open/p1") + req("POST", "/open/p2", "Content-Length: 3",
         body=b"abc") + req("GET", "/open/p3"), 200,
         (fwd("GET", "/open/p1"), fwd("POST", "/open/p2", body=b"abc"), fwd("GET", "/open/p3")), also=(200, 200)),
]


def run_case(gateway: Deployed, upstream: LoggingUpstream, data: bytes | list[bytes], answers: int = 1) -> tuple[
        list[int], list[Received], dict[bytes, bytes]]:
    """Send on one connection and read the expected number of answers; pass a sentinel through on
    another connection (a barrier: what the case caused upstream has arrived by then); then take
    any further answer the first connection produced. Returns statuses, what reached the upstream
    (the sentinel left out) and the first answer's headers."""
    mark = upstream.mark()
    statuses: list[int] = []
    first_headers: dict[bytes, bytes] = {}
    with Conn(gateway.port) as conn:
        conn.sock.settimeout(3)
        for piece in data if isinstance(data, list) else [data]:
            try:
                conn.send(piece)
            except OSError:  # refused and closed before the client finished sending
                break
        for _ in range(answers):
            status, headers, _ = conn.response()
            first_headers = first_headers or headers
            statuses.append(status)
        sentinel = f"/open/sentinel-{uuid.uuid4().hex}"
        with Conn(gateway.port) as other:
            other.send(req("GET", sentinel))
            assert other.response()[0] == 200
        conn.sock.settimeout(0.05)
        try:
            while True:
                statuses.append(conn.response()[0])  # an answer nobody asked for: a smuggled request
        except (ConnectionError, TimeoutError, OSError, IndexError, ValueError):
            pass
    received = upstream.since(mark)
    assert received and received[-1].target == sentinel.encode(), "the sentinel came last"
    return statuses, received[:-1], first_headers


# Where uvicorn's own httptools protocol (GATEWAY_HTTP=uvicorn) is weaker than the gateway's: it
# appends trailer fields to the request's headers (a trailer becomes an identity and is forwarded).
# This is why the gateway ships its own protocol (docs/security.md). Pinned: if uvicorn changes,
# these cases fail until the table is updated.
UVICORN_WEAKER = {
    "trailer-bomb": "uvicorn's protocol buffers an endless trailer without bound",
    "trailer-is-not-an-identity": "uvicorn's protocol turns a trailer into a header",
    "trailer-never-forwarded": "uvicorn's protocol turns a trailer into a header",
    "pipelined-then-malformed": "uvicorn's protocol answers its parser's 400 in place of the answer to the "
                                "request before, which was forwarded",
    "version-2.0": "uvicorn's protocol forwards an HTTP/2.0 request line as HTTP/1.1",
    "version-0.9": "uvicorn's protocol forwards an HTTP/0.9 request line as HTTP/1.1",
    "absolute-form-ftp": "uvicorn's protocol forwards any scheme's absolute-form target",
    "absolute-form-other-scheme": "uvicorn's protocol forwards any scheme's absolute-form target",
    "fields-101": "uvicorn's protocol has no bound on the number of fields",
    "fields-13000-empty": "uvicorn's protocol has no bound on the number of fields",
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_client_side(case: Case, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    status, forwarded = case.uvicorn if case.uvicorn and gateway.server == "uvicorn" else (case.status, case.forwarded)
    expected = [raw.replace(b"{up}", logging_upstream.address.encode()) for raw in forwarded]
    weaker = UVICORN_WEAKER.get(case.id) if gateway.server == "uvicorn" else None
    try:
        statuses, received, headers = run_case(gateway, logging_upstream, case.send, 1 + len(case.also))
        assert statuses[:1] == [status], f"answered {statuses}"
        assert statuses[1:] == list(case.also)
        assert [r.raw for r in received] == expected
    except (AssertionError, ConnectionError):  # ConnectionError: fewer answers than requests
        if weaker:
            logging_upstream.quiet()  # nothing of this case may land in the next one's window
            pytest.xfail(weaker)
        raise
    assert weaker is None, f"uvicorn's protocol now passes {case.id}: update UVICORN_WEAKER and docs/security.md"
    if status >= 400 and gateway.server == "gateway":  # uvicorn answers its parser's refusals as text
        assert headers.get(b"content-type") == b"application/problem+json"


def test_head_over_64k_in_small_writes_is_refused(gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    data = req("GET", "/open/trickle", BIG)
    statuses, received, _ = run_case(gateway, logging_upstream, [data[i:i + 1000] for i in range(0, len(data), 1000)])
    assert statuses[:1] == [431] and received == []


def test_an_endless_trailer_is_refused_and_never_forwarded(
        gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    head = req("POST", "/open/trailer-bomb", "Transfer-Encoding: chunked", body=b"1\r\na\r\n0\r\nX-T: ")
    # 800 KB of one trailer field that never ends: more than one read of the server (up to 256 KB)
    # plus the 64 KiB bound, so the refusal comes whatever the reads' sizes
    writes = [head] + [b"a" * 4000] * 200
    if gateway.server == "uvicorn":
        pytest.xfail(UVICORN_WEAKER["trailer-bomb"])
    statuses, received, _ = run_case(gateway, logging_upstream, writes)
    assert statuses[:1] == [431] and received == []


def test_a_body_that_stops_while_its_digest_is_read_is_a_408(
        gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    started = time.monotonic()
    statuses, received, _ = run_case(gateway, logging_upstream, req("POST", "/digest/a", "Content-Length: 10"))
    assert statuses[:1] == [408] and received == []
    assert time.monotonic() - started < 2.5  # GATEWAY_BODY_TIMEOUT is 1 s here


@pytest.mark.parametrize("path", ["/digest/stalled", "/open/stalled"],
                         ids=["while-its-digest-is-read", "while-forwarded"])
def test_a_408_for_a_stalled_body_closes_the_connection(
        path: str, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    """RFC 9110 15.5.9: the rest of the body may still come; read as a next request, it would be
    one the client never sent as such. The connection ends with the 408: the gateway's answer says
    `Connection: close`, which uvicorn's protocol honours too."""
    with Conn(gateway.port) as conn:
        conn.sock.settimeout(3)
        conn.send(req("POST", path, "Content-Length: 10", body=b"abc"))
        status, headers, _ = conn.response()
        assert status == 408
        assert headers.get(b"connection") == b"close"
        assert conn.closed_by_peer()


def test_http10_without_host_is_forwarded(gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    statuses, received, _ = run_case(
        gateway, logging_upstream, b"GET /open/old HTTP/1.0\r\nX-Request-Id: rid\r\n\r\n")
    assert statuses == [200]
    assert [r.raw for r in received] == [
        b"GET /open/old HTTP/1.1\r\nhost: %s\r\nx-forwarded-for: 127.0.0.1\r\nx-forwarded-proto: http\r\n"
        b"x-request-id: rid\r\n\r\n" % logging_upstream.address.encode()]


@pytest.mark.parametrize("first", [b"GET /open/close-a HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
                                   b"GET /open/close-a HTTP/1.0\r\nHost: gw\r\n\r\n"], ids=["close", "http10"])
def test_bytes_after_a_closing_request_are_never_a_request(
        first: bytes, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    """The parser is lenient about data after `Connection: close` (as uvicorn's: no 400 after the
    answer) by dropping it: one answer, the connection closes, and the upstream never sees /b."""
    run = uuid.uuid4().hex.encode()
    mark = logging_upstream.mark()
    with Conn(gateway.port) as conn:
        second = b"GET /open/close-b-%s HTTP/1.1\r\nHost: gw\r\n\r\n" % run
        conn.send(first.replace(b"close-a", b"close-a-" + run) + second)
        status, headers, _ = conn.response()
        assert status == 200 and headers.get(b"connection") == b"close"
        assert conn.closed_by_peer()
    with Conn(gateway.port) as conn:  # barrier: whatever the connection caused upstream is in by now
        conn.send(b"GET /open/close-barrier-%s HTTP/1.1\r\nHost: gw\r\n\r\n" % run)
        assert conn.response()[0] == 200
    assert [r.target for r in logging_upstream.since(mark) if run in r.target] == [
        b"/open/close-a-" + run, b"/open/close-barrier-" + run]
