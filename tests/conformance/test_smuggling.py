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
