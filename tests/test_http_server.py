"""The client-facing HTTP/1.1 protocol (gateway/http_protocol.py) of a real gateway process, spoken
to over raw sockets: keep-alive, pipelining, 100-continue, HTTP/1.0 and Connection: close, HEAD,
chunked request bodies, and silent connections."""

from __future__ import annotations

import hashlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.raw_http import Conn
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 200ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}", timeout: 2s}}
routes:
  - name: needs-user
    match: {{path: "/echo/needs-user"}}
    upstream: up
    limits:
      - {{name: user, by: [header:X-User], algorithm: fixed_window, limit: 1000, window: 1m}}
  - name: rest
    match: {{path: "/{{rest:path}}"}}
    upstream: up
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    text = CONFIG.format(prefix=f"p{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    proc = GatewayProcess(text, tmp_path_factory.mktemp("protocol"), redis_url=redis_proc.url,
                          env={"GATEWAY_HEADER_TIMEOUT": "1"})
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: a\r\n{extra}\r\n".encode()


def test_keep_alive_serves_many_requests_on_one_connection(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        for i in range(5):
            conn.send(get(f"/echo/k{i}"))
            status, _, body = conn.response()
            assert status == 200 and json.loads(body)["path"] == f"/echo/k{i}"


def test_pipelined_requests_are_answered_in_order(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        conn.send(get("/slow?delay=0.2") + get("/echo/second") + get("/echo/third"))
        answers = [conn.response() for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert json.loads(answers[0][2]) == {"slow": True}
        assert [json.loads(body)["path"] for _, _, body in answers[1:]] == ["/echo/second", "/echo/third"]


def test_expect_100_continue_is_answered_before_the_body_is_sent(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        conn.send(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        status, _, _ = conn.response()
        assert status == 100
        conn.send(b"hello")
        status, _, body = conn.response()
        assert status == 200
        assert json.loads(body) == {"length": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}


def test_chunked_request_body_is_forwarded_exactly(gateway: GatewayProcess) -> None:
    pieces = [b"a" * 10, b"b" * 70000, b"c"]
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    with Conn(gateway.port) as conn:
        conn.send(b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        status, _, body = conn.response()
        whole = b"".join(pieces)
        assert status == 200
        assert json.loads(body) == {"length": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}


def test_http_10_and_connection_close_end_the_connection_after_the_response(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        conn.send(b"GET /echo/old HTTP/1.0\r\n\r\n")
        status, headers, _ = conn.response()
        assert status == 200 and headers.get(b"connection") == b"close"
        assert conn.closed_by_peer()
    with Conn(gateway.port) as conn:
        conn.send(get("/echo/bye", "Connection: close\r\n"))
        status, _, _ = conn.response()
        assert status == 200
        assert conn.closed_by_peer()


def test_head_answers_carry_no_body_even_when_the_gateway_answers_itself(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        conn.send(b"HEAD /echo/needs-user HTTP/1.1\r\nHost: a\r\n\r\n")  # no X-User: 400 problem
        status, headers, _ = conn.response(head_only=True)
        assert status == 400 and int(headers[b"content-length"]) > 0
        conn.send(get("/echo/after-head"))  # had a body leaked, this would read garbage
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["path"] == "/echo/after-head"


def test_a_silent_connection_is_closed_after_the_header_timeout(gateway: GatewayProcess) -> None:
    with Conn(gateway.port) as conn:
        assert conn.closed_by_peer()  # within the 5 s socket timeout; GATEWAY_HEADER_TIMEOUT is 1 s


def test_a_client_that_closes_its_side_after_its_request_has_gone_as_nginx_reads_it(
        gateway: GatewayProcess, upstream: Upstream) -> None:
    """SPEC section 4: a client that closes its connection while its request is at the upstream is
    noticed at once, as nginx does (proxy_ignore_client_abort off, which reads a FIN so): the
    request is abandoned and the connection closed without an answer. (Until this round a
    half-closed client was still answered; tests/test_client_gone.py has the rest.)"""
    before = upstream.arrived("/slow")
    with Conn(gateway.port) as conn:
        conn.send(get("/slow?delay=10"))
        wait_until(lambda: upstream.arrived("/slow") > before, timeout=5)  # the request is at the upstream
        conn.sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        assert conn.sock.recv(65536) == b""  # closed, no answer
        assert time.monotonic() - started < 5  # not the upstream's answer, 10 s away, that ended it


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_client_that_stops_reading_holds_back_the_upstream_not_the_gateways_memory(
    gateway: GatewayProcess,
) -> None:
    size = 200 * 1024 * 1024
    pids = gateway.worker_pids()
    before = {pid: _rss_kb(pid) for pid in pids}
    with Conn(gateway.port) as conn:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        conn.send(get(f"/bytes?size={size}"))
        time.sleep(2)  # not reading: only socket buffers and the gateway's high-water marks fill
        growth_mb = max(_rss_kb(pid) - before[pid] for pid in pids) / 1024
        assert growth_mb < 32, f"a worker grew by {growth_mb:.0f} MiB while its client read nothing"
        conn.sock.settimeout(30)
        status, headers, _ = conn.response(head_only=True)
        assert status == 200 and int(headers[b"content-length"]) == size
        received = len(conn.buffer)
        conn.buffer = b""
        while received < size:
            chunk = conn.sock.recv(1 << 20)
            assert chunk, f"closed after {received} bytes"
            received += len(chunk)
        assert received == size


def test_pipelined_requests_are_bounded_per_connection(gateway: GatewayProcess) -> None:
    """Issue 33: one read of tiny pipelined requests behind a slow one queued thousands of them
    (3-5 MiB of worker memory a connection). Past MAX_PIPELINED the next is a 503, those before it
    are answered in order, and the connection ends."""
    from gateway.http.server import MAX_PIPELINED

    pids = gateway.worker_pids()
    before = {pid: _rss_kb(pid) for pid in pids}
    tiny = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
    with Conn(gateway.port) as conn:
        conn.send(get("/slow?delay=1") + tiny * 5000)
        conn.sock.settimeout(15)
        statuses = []
        while True:
            try:
                status, _, _ = conn.response()
            except (ConnectionError, AssertionError, TimeoutError):
                break
            statuses.append(status)
            if status == 503:
                break
    assert statuses[0] == 200 and statuses[1:MAX_PIPELINED + 1] == [200] * MAX_PIPELINED
    assert statuses[-1] == 503 and len(statuses) == MAX_PIPELINED + 2
    growth_mb = max(_rss_kb(pid) - before[pid] for pid in pids) / 1024
    assert growth_mb < 3, f"a worker grew by {growth_mb:.1f} MiB for one connection's pipeline"
