"""Request bodies cannot hold upstream connections at a client's pace (issue 17, V6).

The `few` upstream allows 4 connections, and a request waits at most 0.5 s for one (504 after).
Twenty clients announce a 1,000-byte body and send it a byte at a time, each byte within the body
timeout (1 s here): no byte stalls long enough to be refused, yet none of the bodies ends. A small
body is read whole before an upstream connection is taken, so these twenty hold none, and every
other request to that upstream is served meanwhile.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid

from tests.conformance.conftest import Deployed
from tests.conformance.upstream import LoggingUpstream
from tests.support.raw_http import Conn

SLOW = 20


def test_slow_small_bodies_never_starve_the_upstream_pool(gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    run = uuid.uuid4().hex[:8]
    slow: list[socket.socket] = []
    try:
        for i in range(SLOW):
            sock = socket.create_connection(("127.0.0.1", gateway.port))
            sock.sendall(f"POST /pooled/slow-{run}-{i} HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n".encode())
            slow.append(sock)

        def trickle() -> None:
            for sock in slow:
                # one refused as too slow after all (a loaded machine's pause) holds nothing either
                with contextlib.suppress(OSError):
                    sock.sendall(b"x")

        statuses = []
        for i in range(6):
            trickle()
            with Conn(gateway.port) as conn:
                conn.send(f"GET /pooled/other-{run}-{i} HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
                statuses.append(conn.response()[0])
            time.sleep(0.3)
        assert statuses == [200] * 6
    finally:
        for sock in slow:
            sock.close()
        logging_upstream.quiet()
