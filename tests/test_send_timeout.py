"""Issue 33: clients that stop reading a large answer held their concurrency slots (the lease kept
renewing) and an upstream connection for as long as their sockets stayed open. Now a client that
takes nothing of its answer for `send_timeout` (GATEWAY_SEND_TIMEOUT, SPEC section 4's 60 s; 2 s
here) is cut, as nginx's send_timeout does: its call is cancelled, its slot and its upstream
connection go back. A slow reader that keeps taking bytes is never cut, neither by send_timeout nor
by the upstream's read timeout: while an answer waits for its client, the upstream is not late."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

CONFIG = """\
version: 1
upstreams: {{up: {{url: "{url}", max_connections: 2, timeout: {upstream_timeout}s}}}}
routes:
  - name: big
    match: {{path: "/bytes"}}
    upstream: up
    limits: [{{name: one, by: [], algorithm: concurrency, limit: 1, lease: 60s}}]
"""
SEND_TIMEOUT = within(2.0)  # a time limit of the suite's: on a busy machine a slow reader is slower
SIZE = 200 * 1024 * 1024


@contextmanager
def running(tmp_path: Path, redis_url: str, upstream_url: str, send_timeout: float,
            upstream_timeout: float = 10.0) -> Iterator[GatewayProcess]:
    process = GatewayProcess(CONFIG.format(url=upstream_url, upstream_timeout=upstream_timeout), tmp_path,
                             redis_url=redis_url, env={"GATEWAY_SEND_TIMEOUT": str(send_timeout)})
    process.start()
    try:
        yield process
    finally:
        process.stop()
        assert "Traceback" not in process.log(), process.log()


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    with running(tmp_path, redis_proc.url, upstream.url, SEND_TIMEOUT) as process:
        yield process


def stalled(port: int) -> socket.socket:
    """A client that asks for 200 MiB and reads none of it."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.sendall(b"GET /bytes?size=%d HTTP/1.1\r\nHost: a\r\n\r\n" % SIZE)
    return sock


def test_a_client_that_reads_nothing_is_cut_and_its_slot_goes_back(gateway: GatewayProcess) -> None:
    sock = stalled(gateway.port)
    try:
        time.sleep(0.5)  # its answer has started: it holds the one slot
        assert httpx.get(f"{gateway.url}/bytes?size=10").status_code == 429
        started = time.monotonic()
        deadline = started + SEND_TIMEOUT + 10
        while time.monotonic() < deadline:  # the slot comes back once the stalled client is cut
            if httpx.get(f"{gateway.url}/bytes?size=10").status_code == 200:
                break
            time.sleep(0.1)
        assert time.monotonic() < deadline, "the stalled client kept its slot"
        assert time.monotonic() - started >= SEND_TIMEOUT - 0.6  # not before the timeout
        sock.settimeout(10)
        read = 0
        with _ended():
            while chunk := sock.recv(1 << 20):
                read += len(chunk)
        assert read < SIZE, "the stalled client was cut, not served"
    finally:
        sock.close()
    assert "took nothing of its answer" in gateway.log()


class _ended:
    """A socket's end, whether a FIN or a reset."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, tb: object) -> bool:
        return kind is None or kind is ConnectionResetError


# A slow reader of an answer larger than the kernel's send buffer (autotuned up to 4 MiB): the
# kernel reports the full socket writable only once half its queue is gone, seconds apart at this
# pace; and the upstream's bytes wait in the gateway meanwhile. Before, the first cut the answer at
# 4,125,975 bytes with send_timeout 1 s, the second at 5,248,279 with an upstream timeout of 1 s.
@pytest.mark.parametrize(("send_timeout", "upstream_timeout"), [(within(1.0), 10.0), (60.0, within(1.0))],
                         ids=["send_timeout", "upstream_timeout"])
def test_a_slow_reader_that_keeps_reading_is_never_cut(
    tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, send_timeout: float, upstream_timeout: float,
) -> None:
    size = 6 * 1024 * 1024
    with running(tmp_path, redis_proc.url, upstream.url, send_timeout, upstream_timeout) as gateway, \
            socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        sock.sendall(b"GET /bytes?size=%d HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" % size)
        received = 0
        while chunk := sock.recv(32 * 1024):
            received += len(chunk)
            time.sleep(0.03)  # about 1 MB/s: slow, and never stopped
        assert received > size, gateway.log()  # the whole answer and its head
        assert "took nothing of its answer" not in gateway.log()
