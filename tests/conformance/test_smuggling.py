"""Smuggling regression: with a route limited to 1 request per hour, no sequence of client
connections gets a second request for it to the upstream — the outside probe's Upgrade +
Content-Length desync, and its CL.TE, TE.CL, pipelined and split-write variants. Each sequence
ends with plain requests on fresh connections, the ones a hidden request would ride in on."""

from __future__ import annotations

import uuid

import pytest

from tests.conformance.conftest import Deployed
from tests.conformance.upstream import LoggingUpstream
from tests.support.raw_http import Conn


def hidden(run: str) -> bytes:
    return f"GET /limited/{run}/secret HTTP/1.1\r\nHost: gw\r\n\r\n".encode()


def plain(run: str, name: str) -> bytes:
    return f"GET /limited/{run}/{name} HTTP/1.1\r\nHost: gw\r\n\r\n".encode()


def sequences(run: str) -> dict[str, list[list[bytes]]]:
    """name -> connections, each a list of writes."""
    secret = hidden(run)
    return {
        "upgrade-with-length": [[
            f"POST /limited/{run}/early HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
            f"Content-Length: {len(secret)}\r\n\r\n".encode() + secret]],
        "upgrade-then-body-later": [[
            f"POST /limited/{run}/early HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
            f"Content-Length: {len(secret)}\r\n\r\n".encode(), secret]],
        "cl-te": [[
            f"POST /limited/{run}/a HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(secret) + 5}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode() + secret]],
        "te-cl": [[
            f"POST /limited/{run}/a HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
            f"{len(secret):x}\r\n".encode() + secret + b"\r\n0\r\n\r\n"]],
        "te-obfuscated": [[
            f"POST /limited/{run}/a HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\nTransfer-Encoding: xchunked\r\n\r\n"
            "0\r\n\r\n".encode() + secret]],
        "pipelined-after-admitted": [[plain(run, "first") + secret + plain(run, "third")]],
        "body-carrying-a-request": [[
            f"POST /limited/{run}/a HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(secret)}\r\n\r\n".encode() + secret]],
        "split-writes": [split(plain(run, "x") + secret, 7)],
    }


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


NAMES = sorted(sequences("x"))


@pytest.mark.parametrize("name", NAMES)
def test_no_second_request_reaches_a_route_limited_to_one(name: str, gateway: Deployed,
                                                          logging_upstream: LoggingUpstream) -> None:
    run = uuid.uuid4().hex
    mark = logging_upstream.mark()
    connections = [*sequences(run)[name], [plain(run, "after-1")], [plain(run, "after-2")]]
    closer = b"GET /open/close HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    for writes in connections:
        with Conn(gateway.port) as conn:
            conn.sock.settimeout(2)
            try:
                for data in [*writes, closer]:  # the next request a desync would eat; then the end
                    conn.send(data)
                while True:
                    conn.response()
            except (ConnectionError, TimeoutError, OSError, IndexError, ValueError):
                pass
    with Conn(gateway.port) as conn:  # barrier: whatever the sequence caused upstream is in by now
        conn.send(b"GET /open/barrier-%s HTTP/1.1\r\nHost: gw\r\n\r\n" % run.encode())
        assert conn.response()[0] == 200
    reached = [r for r in logging_upstream.since(mark) if run.encode() in r.raw and b"/open/barrier" not in r.target]
    assert len(reached) <= 1, [r.raw[:200] for r in reached]
    for r in reached:  # and what did reach it was a whole, ordinary request, not one hidden in a body
        assert b"secret" not in r.target


def refused(run: str) -> dict[str, tuple[list[bytes], str]]:
    """name -> (the writes of one connection, the route's path prefix): requests the framing checks
    refuse, each aimed at a route limited to 1 per hour."""
    head = f"POST /limited/{run}/refused HTTP/1.1\r\nHost: gw\r\n"
    user = f"GET /limited-user/refused HTTP/1.1\r\nHost: gw\r\nX-User-Id: {run}\r\n"
    chunked = head + "Transfer-Encoding: chunked\r\n\r\n"
    return {
        "cl-te": ([f"{head}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode()], "limited"),
        "te-cl": ([f"{head}Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n".encode()], "limited"),
        "two-lengths": ([f"{head}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!".encode()], "limited"),
        "te-gzip": ([f"{head}Transfer-Encoding: gzip\r\n\r\nhello".encode()], "limited"),
        "te-gzip-head-alone": ([f"{head}Transfer-Encoding: gzip\r\n\r\n".encode(), b"hello"], "limited"),
        "te-gzip-chunked": ([f"{head}Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n".encode()], "limited"),
        "te-identity": ([f"{head}Transfer-Encoding: identity\r\nContent-Length: 5\r\n\r\nhello".encode()], "limited"),
        "two-hosts": ([f"{head}Host: other\r\nContent-Length: 0\r\n\r\n".encode()], "limited"),
        "upgrade-with-length": ([f"{head}Connection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 5\r\n\r\nhello"
                                 .encode()], "limited"),
        "websocket": ([f"GET /limited/{run}/ws HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket"
                       "\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()],
                      "limited"),
        "bad-chunk-size": ([f"{chunked}zz\r\nhello\r\n0\r\n\r\n".encode()], "limited"),
        "chunk-size-overflow": ([f"{chunked}ffffffffffffffffff\r\nhello\r\n0\r\n\r\n".encode()], "limited"),
        "bare-lf-chunk": ([f"{chunked}5\nhello\n0\n\n".encode()], "limited"),
        "length-not-a-number": ([f"{head}Content-Length: +5\r\n\r\nhello".encode()], "limited"),
        "bare-lf-head": ([f"POST /limited/{run}/refused HTTP/1.1\nHost: gw\nContent-Length: 0\n\n".encode()],
                         "limited"),
        "identity-twice": ([f"{user}X-User-Id: other\r\n\r\n".encode()], "limited-user"),
        "identity-underscore-twin": ([f"{user}X-User_Id: other\r\n\r\n".encode()], "limited-user"),
        "identity-named-in-connection": ([f"{user}Connection: X-User-Id\r\n\r\n".encode()], "limited-user"),
    }


REFUSED = sorted(refused("x"))
# uvicorn's own protocol (GATEWAY_HTTP=uvicorn) starts the app on the head and answers the parser's
# 400 beside it: a chunked body the parser refuses in the same read has been counted by then.
# Pinned: if uvicorn changes, these fail until the set is updated (docs/security.md).
UVICORN_COUNTS = {"bad-chunk-size", "bare-lf-chunk", "chunk-size-overflow"}


@pytest.mark.parametrize("name", REFUSED)
def test_a_request_refused_for_its_framing_is_neither_forwarded_nor_counted(
        name: str, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    """The request refused first takes nothing from the route's one request an hour: the valid
    request sent after it is admitted, and it is the only one the upstream receives."""
    weaker = gateway.server == "uvicorn" and name in UVICORN_COUNTS
    try:
        check_refused_first(name, gateway, logging_upstream)
    except AssertionError:
        if weaker:
            logging_upstream.quiet()  # nothing of this case may land in the next one's window
            pytest.xfail("uvicorn's protocol enters the app before the parser refuses the body")
        raise
    assert not weaker, f"uvicorn's protocol now passes {name}: update UVICORN_COUNTS and docs/security.md"


def check_refused_first(name: str, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    run = uuid.uuid4().hex
    writes, route = refused(run)[name]
    mark = logging_upstream.mark()
    with Conn(gateway.port) as conn:
        conn.sock.settimeout(2)
        try:
            for data in writes:
                conn.send(data)
            status = conn.response()[0]
        except (ConnectionError, TimeoutError, OSError, IndexError, ValueError) as exc:
            raise AssertionError(f"no answer to the refused request: {exc!r}") from None
        assert 400 <= status < 600 and status != 429, status
    valid = (f"GET /limited/{run}/valid HTTP/1.1\r\nHost: gw\r\n\r\n" if route == "limited" else
             f"GET /limited-user/valid HTTP/1.1\r\nHost: gw\r\nX-User-Id: {run}\r\n\r\n").encode()
    with Conn(gateway.port) as conn:
        conn.send(valid)
        assert conn.response()[0] == 200, "the refused request was counted against the limit"
    with Conn(gateway.port) as conn:  # barrier: whatever the refused request caused upstream is in by now
        conn.send(b"GET /open/barrier-%s HTTP/1.1\r\nHost: gw\r\n\r\n" % run.encode())
        assert conn.response()[0] == 200
    reached = [r.target for r in logging_upstream.since(mark) if b"/open/barrier" not in r.target]
    assert reached == [valid.split(b" ")[1]]
