"""Clients that stop reading a large answer held their concurrency slots (the lease kept renewing)
and an upstream connection for as long as their sockets stayed open. A client that takes nothing of
its answer for `send_timeout` (GATEWAY_SEND_TIMEOUT, SPEC section 4's 60 s; seconds here) is cut, as
nginx's send_timeout does: its call is cancelled, its slot and its upstream connection go back. The
time counts from the last bytes the client took: a client with a 4 KiB window whose kernel takes a
last 2 KiB a moment after the gateway began to wait is cut one timeout later, not two (it was cut at
19.3 s with a 9.6 s timeout). A slow reader that keeps taking bytes is never cut, neither by
send_timeout nor by the upstream's read timeout: while an answer waits for its client, the upstream
is not late."""

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
from tests.support.waiting import wait_until
from tests.support.ws_upstream import WsUpstream

CONFIG = """\
version: 1
upstreams: {{up: {{url: "{url}", max_connections: 2, timeout: {upstream_timeout}s}}}}
routes:
  - name: big
    match: {{path: "/bytes"}}
    upstream: up
    limits: [{{name: one, by: [], algorithm: concurrency, limit: 1, lease: 60s}}]
  - name: stream
    match: {{path: "/drip"}}
    upstream: up
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
        # its answer has started: it holds the one slot
        wait_until(lambda: httpx.get(f"{gateway.url}/bytes?size=10").status_code == 429, timeout=10)
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


STOPPED_CONFIG = """\
version: 1
upstreams: {{up: {{url: "{url}", max_connections: 2, timeout: 10s}}}}
routes:
  - name: download
    match: {{path: "/bytes"}}
    upstream: up
    limits: [{{name: two, by: [], algorithm: concurrency, limit: 2, lease: 60s}}]
  - name: stream
    match: {{path: "/drip"}}
    upstream: up
    limits: [{{name: two, by: [], algorithm: concurrency, limit: 2, lease: 60s}}]
  - name: other
    match: {{path: "/echo"}}
    upstream: up
"""
STOPPED_TIMEOUT = within(4.0)


DOWNLOAD = b"/bytes?size=%d" % (64 << 20)
STREAM = b"/drip?chunk=4096&every=0.1"  # 40 KB/s: a minute before the kernel's queue on loopback is full
TCP_ESTABLISHED = 1  # tcp_info's tcpi_state (Linux)
SHORT = {DOWNLOAD: "/bytes?size=10", STREAM: "/drip?chunk=10&count=1"}  # a third request on each route


def small_window(port: int) -> socket.socket:
    """A connection whose client offers a 4 KiB receive window (set before it connects, so the
    window it announces stays that small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def stopped_reader(port: int, target: bytes = DOWNLOAD) -> socket.socket:
    """A client with a 4 KiB window that asks for `target` (64 MiB by default)."""
    sock = small_window(port)
    sock.sendall(b"GET %b HTTP/1.1\r\nHost: a\r\n\r\n" % target)
    return sock


def _status(url: str) -> int:
    return httpx.get(url, timeout=10).status_code


def _answered(url: str, status: int, deadline: float) -> bool:
    """Whether `url` answers `status` before `deadline` (time.monotonic()), asked again and again."""
    while time.monotonic() < deadline:
        if _status(url) == status:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("target", [DOWNLOAD, STREAM], ids=["download", "stream"])
def test_readers_that_stop_give_back_their_slots_and_upstream_connections(
    tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, target: bytes,
) -> None:
    """Two stopped readers hold the route's 2 slots and the upstream's 2 connections: a third
    request is refused (429) and any other request to that upstream finds the pool busy (504).
    Both come back once they have taken nothing for `send_timeout`, and not a whole timeout later
    (the client's kernel taking its last few KiB after the wait began is not a reader's progress),
    nor once the kernel's send queue is full (a stream at 40 KB/s takes a minute to fill it)."""
    process = GatewayProcess(STOPPED_CONFIG.format(url=upstream.url), tmp_path, redis_url=redis_proc.url,
                             env={"GATEWAY_SEND_TIMEOUT": str(STOPPED_TIMEOUT)})
    process.start()
    clients: list[socket.socket] = []
    try:
        clients = [stopped_reader(process.port, target) for _ in range(2)]  # and never read a byte
        sent = time.monotonic()
        third = process.url + SHORT[target]
        assert _answered(third, 429, sent + within(10))  # both answers began
        assert _status(f"{process.url}/echo") == 504  # the pool's 2 connections are theirs
        deadline = sent + STOPPED_TIMEOUT * 1.5
        while not all(map(_cut, clients)) and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = time.monotonic() - sent
        assert all(map(_cut, clients)), f"still connected {waited:.1f}s after (send_timeout {STOPPED_TIMEOUT:.1f}s)"
        assert waited >= STOPPED_TIMEOUT - 0.5  # not before they had taken nothing for that long
        assert _answered(third, 200, deadline), "the stopped readers kept their slots"
        assert _answered(f"{process.url}/echo", 200, deadline), "the stopped readers kept the upstream's connections"
        print(f"\ncut {waited:.2f}s after the requests (send_timeout {STOPPED_TIMEOUT:.1f}s)")
    finally:
        for sock in clients:
            sock.close()
        process.stop()
    assert process.log().count("took nothing of its answer") == 2, process.log()
    assert "Traceback" not in process.log(), process.log()


def _cut(sock: socket.socket) -> bool:
    """Whether the gateway ended this connection (the client's TCP left ESTABLISHED), read or not."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED


def test_a_reader_with_a_small_window_that_pauses_less_than_the_timeout_is_never_cut(
    tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream,
) -> None:
    """The same 4 KiB window, read a little at a time with pauses of a third of `send_timeout`
    (a few KiB a second): slow, but never stopped for as long as the timeout."""
    send_timeout = within(1.0)
    with running(tmp_path, redis_proc.url, upstream.url, send_timeout) as gateway, stopped_reader(gateway.port) as sock:
        sock.settimeout(10)
        until = time.monotonic() + 3 * send_timeout
        received = 0
        while time.monotonic() < until:
            chunk = sock.recv(4096)
            assert chunk, f"cut after {received} bytes:\n{gateway.log()}"
            received += len(chunk)
            time.sleep(send_timeout / 3)
        assert received > 8 * 1024  # it kept taking its answer, a few KiB at a time
        assert "took nothing of its answer" not in gateway.log()


def test_a_stream_reader_that_keeps_up_is_never_cut_by_pauses_of_the_stream(
    tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream,
) -> None:
    """A stream whose events come further apart than `send_timeout`, read as they come: nothing
    waits for the client between them, so the pauses are the upstream's, never the client's."""
    send_timeout = within(1.0)
    target = b"/drip?chunk=4096&every=%.2f&count=3" % (send_timeout * 1.5)
    with running(tmp_path, redis_proc.url, upstream.url, send_timeout) as gateway, \
            stopped_reader(gateway.port, target) as sock:
        sock.settimeout(10 * send_timeout)
        received = b""
        while not received.endswith(b"0\r\n\r\n") and (chunk := sock.recv(65536)):
            received += chunk
        assert received.endswith(b"0\r\n\r\n") and received.count(b"d" * 4096) == 3, received[:200]
        assert "took nothing of its answer" not in gateway.log()


TUNNEL_CONFIG = """\
version: 1
upstreams: {{ws: {{url: "{url}"}}}}
routes:
  - name: feed
    match: {{path: "/drip"}}
    upstream: ws
    websocket: true
    limits: [{{name: one, by: [], algorithm: concurrency, limit: 1, lease: 60s}}]
"""
HANDSHAKE = (b"GET /drip HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
             b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


def _handshake_status(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HANDSHAKE)
        return sock.recv(12)[9:12]


def test_a_tunnel_client_that_stops_reading_gives_back_its_slot(
    tmp_path: Path, redis_proc: RedisProcess,
) -> None:
    """The same for a WebSocket tunnel whose upstream sends 40 KB/s: a client that stops reading
    is cut `send_timeout` after, not once the kernel's send queue is full, and its slot goes back."""
    ws = WsUpstream()
    ws.start()
    process = GatewayProcess(TUNNEL_CONFIG.format(url=ws.url), tmp_path, redis_url=redis_proc.url,
                             env={"GATEWAY_SEND_TIMEOUT": str(STOPPED_TIMEOUT)})
    try:
        process.start()
        with small_window(process.port) as client:
            client.sendall(HANDSHAKE)  # and never reads a byte
            sent = time.monotonic()
            deadline = sent + STOPPED_TIMEOUT * 1.5
            assert _handshake_status(process.port) == b"429"  # the one slot is the tunnel's
            while not _cut(client) and time.monotonic() < deadline:
                time.sleep(0.05)
            waited = time.monotonic() - sent
            assert _cut(client), f"still connected {waited:.1f}s after (send_timeout {STOPPED_TIMEOUT:.1f}s)"
            assert waited >= STOPPED_TIMEOUT - 0.5
            admitted = False
            while not admitted and time.monotonic() < deadline:
                admitted = _handshake_status(process.port) == b"101"
            assert admitted, "the stopped tunnel kept its slot"
    finally:
        process.stop()
        ws.stop()
    assert "took nothing of its answer" in process.log(), process.log()
    assert "Traceback" not in process.log(), process.log()


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
