"""Property: over mutated request heads, bodies, paths and pipelining, the upstream never receives
more requests than the gateway admitted, and each one it receives has the method, the normalized
path and the one identity header the decision used.

Requests go to `/user/...` (limited by X-User-Id). Each carries a unique marker; its path is built
from pieces whose normalized form is known by construction (or that must be refused), and its head
from mutations that must either pass unchanged or be refused. Runs against the shipped pair: the
gateway's server protocol and the lean transport.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conformance.conftest import Deployed
from tests.conformance.upstream import LoggingUpstream
from tests.support.raw_http import Conn

# path pieces between "/user" and "/<marker>": (raw, contributes to the normalized path, valid)
PIECES = [
    ("", "", True), ("/./", "/", True), ("//", "/", True), ("/x/..", "", True), ("/%2e", "", True),
    ("/%61", "/a", True), ("/a%20b", "/a%20b", True), ("/%2f", "", False), ("/..%2F", "", False),
    ("/%00", "", False), ("/%zz", "", False), ("/%5c", "", False), ("/../..", "", False),
]
# head mutations: (extra fields, whether the request may still be admitted)
MUTATIONS = [
    ((), True),
    (("X-Other: 1", "X-Other: 2"), True),
    (("Connection: keep-alive",), True),
    (("X-User-Id: mallory",), False),                     # the identity twice
    (("Connection: X-User-Id",), False),                  # the identity named hop-by-hop
    (("Transfer-Encoding: chunked",), False),             # with a Content-Length below
    (("Upgrade: h2c", "Connection: Upgrade"), False),
    (("Transfer-Encoding: gzip",), False),
    (("Host: other",), False),                            # a second Host
]


@dataclass(frozen=True)
class Sent:
    method: str
    marker: str
    raw: bytes
    expected_path: str | None   # None: must not be admitted
    user: str


@st.composite
def requests(draw: st.DrawFn) -> Sent:
    marker = uuid.uuid4().hex[:12]
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    pieces = draw(st.lists(st.sampled_from(PIECES), max_size=3))
    fields, admissible = draw(st.sampled_from(MUTATIONS))
    raw_path = "/user" + "".join(p[0] for p in pieces) + "/" + marker
    normalized = "/user" + "".join(p[1] for p in pieces) + "/" + marker
    while "//" in normalized:
        normalized = normalized.replace("//", "/")
    valid = all(p[2] for p in pieces) and admissible
    user = f"u{draw(st.integers(0, 9))}"
    body = draw(st.sampled_from([b"", b"hello", b"x" * 70]))
    if method in ("POST", "PUT"):
        if "Transfer-Encoding: chunked" in fields:
            framing = [f"Content-Length: {len(body)}"]
        elif "Transfer-Encoding: gzip" in fields:
            framing = []
        else:
            framing = [f"Content-Length: {len(body)}"]
    else:
        body, framing = b"", [f for f in ["Content-Length: 0"] if "Transfer-Encoding: chunked" in fields]
    lines = [f"{method} {raw_path} HTTP/1.1", "Host: gw", f"X-User-Id: {user}", *fields, *framing]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    return Sent(method, marker, raw, normalized if valid else None, user)


@pytest.mark.parametrize("gateway", [("gateway", "lean")], indirect=True,
                         ids=["gateway-server+lean-transport"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=4), chunk=st.sampled_from([0, 1, 13, 100]))
def test_the_upstream_sees_only_what_was_admitted_as_it_was_decided(
        batch: list[Sent], chunk: int, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    data = b"".join(s.raw for s in batch)
    writes = [data] if not chunk else [data[i:i + chunk] for i in range(0, len(data), chunk)]
    mark = logging_upstream.mark()
    statuses: list[int] = []
    with Conn(gateway.port) as conn:
        conn.sock.settimeout(2)
        try:
            for piece in writes:
                conn.send(piece)
            for _ in batch:
                statuses.append(conn.response()[0])
        except (ConnectionError, TimeoutError, OSError, IndexError, ValueError):
            pass  # refused with the connection closed: the rest goes unanswered
    barrier = uuid.uuid4().hex
    with Conn(gateway.port) as conn:
        conn.send(b"GET /open/barrier-%s HTTP/1.1\r\nHost: gw\r\n\r\n" % barrier.encode())
        assert conn.response()[0] == 200
    received = [r for r in logging_upstream.since(mark) if barrier.encode() not in r.target]

    admitted = [sent for sent, status in zip(batch, statuses, strict=False) if status == 200]
    assert len(received) == len(admitted), (statuses, [r.target for r in received])
    for sent, got in zip(admitted, received, strict=True):
        assert sent.expected_path is not None, f"{sent.raw!r} should have been refused"
        assert got.head.startswith(f"{sent.method} {sent.expected_path} HTTP/1.1\r\n".encode())
        identity = [line for line in got.head.split(b"\r\n") if line.lower().startswith(b"x-user-id:")]
        assert identity == [f"x-user-id: {sent.user}".encode()]
