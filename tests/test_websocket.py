"""WebSocket tunnels end to end (SPEC section 4, issue 21): a real gateway process, a real
`websockets` upstream and client, a real Redis.

A handshake on a `websocket: true` route is decided like any request and forwarded; a 101 starts a
byte relay both ways (backpressure, idle timeout, drain on SIGTERM); any other answer is an ordinary
response after which nothing is read as a tunnel. Other upgrades stay 501; a handshake with a body
is a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as connect_sync

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until
from tests.support.ws_upstream import WsUpstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  ws: {{url: "{ws}", timeout: 2s}}
  http: {{url: "{http}", timeout: 2s}}
routes:
  - name: chat
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: ws
    websocket: true
  - name: limited
    match: {{path: "/limited/{{room}}"}}
    upstream: ws
    websocket: true
    limits:
      - {{name: room, by: ["path:room"], algorithm: fixed_window, limit: 3, window: 1h}}
  - name: source
    match: {{path: "/source/{{mib}}"}}
    upstream: ws
    websocket: true
  - name: refused
    match: {{path: /refuse}}
    upstream: ws
    websocket: true
  - name: idle
    match: {{path: /idle/echo}}
    upstream: ws
    websocket: true
    websocket_idle_timeout: 1s
  - name: plain
    match: {{path: "/plain/{{rest:path}}"}}
    upstream: http
"""

KEY = "dGhlIHNhbXBsZSBub25jZQ=="
MiB = 1 << 20


@pytest.fixture(scope="module")
def ws_upstream() -> Iterator[WsUpstream]:
    server = WsUpstream()
    server.start()
    yield server
    server.stop()


def start_gateway(workdir: Path, redis: RedisProcess, ws: WsUpstream, http: Upstream,
                  env: dict[str, str] | None = None) -> GatewayProcess:
    text = CONFIG.format(prefix=f"w{uuid.uuid4().hex[:8]}", ws=ws.url, http=http.url)
    proc = GatewayProcess(text, workdir, redis_url=redis.url, workers=1, env=env)
    proc.start()
    return proc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess, ws_upstream: WsUpstream,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    proc = start_gateway(tmp_path_factory.mktemp("gw"), redis_proc, ws_upstream, upstream)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def ws_url(gateway: GatewayProcess, path: str) -> str:
    return f"ws://127.0.0.1:{gateway.port}{path}"


def handshake(path: str, *extra: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: gw", "Connection: Upgrade", "Upgrade: websocket",
             "Sec-WebSocket-Version: 13", f"Sec-WebSocket-Key: {KEY}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def exchange(gateway: GatewayProcess, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data` on a new connection; everything the gateway sends until it closes (or `wait`)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=wait) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        return received


def test_messages_are_echoed_through_the_tunnel(gateway: GatewayProcess) -> None:
    with connect_sync(ws_url(gateway, "/echo/room"), max_size=None) as ws:
        ws.send("hello")
        assert ws.recv() == "hello"
        ws.send(b"\x00\x01binary\xff")
        assert ws.recv() == b"\x00\x01binary\xff"
        for i in range(50):
            ws.send(f"message {i}")
        assert [ws.recv() for _ in range(50)] == [f"message {i}" for i in range(50)]
        assert ws.response is not None
        assert ws.response.headers["X-Request-Id"]


def test_bytes_the_client_sends_with_its_handshake_reach_the_upstream_after_the_101(gateway: GatewayProcess) -> None:
    # a masked text frame "hi" (RFC 6455 5.7) in the same write as the head: the upstream echoes it
    mask = b"\x01\x02\x03\x04"
    frame = b"\x81\x82" + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(b"hi"))
    received = exchange(gateway, handshake("/echo/early") + frame, wait=2.0)
    assert received.startswith(b"HTTP/1.1 101 "), received[:200]
    assert received.endswith(b"\x81\x02hi"), received[-50:]


def test_a_handshake_pipelined_behind_a_request_is_answered_after_it_and_then_tunneled(
        gateway: GatewayProcess) -> None:
    mask = b"\x01\x02\x03\x04"
    frame = b"\x81\x82" + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(b"hi"))
    first = b"GET /plain/first HTTP/1.1\r\nHost: gw\r\n\r\n"
    received = exchange(gateway, first + handshake("/echo/pipelined") + frame, wait=2.0)
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]
    assert b"HTTP/1.1 101 " in received
    assert received.endswith(b"\x81\x02hi"), received[-50:]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_100_mib_each_way_arrive_intact_in_flat_gateway_memory(gateway: GatewayProcess) -> None:
    [worker] = gateway.worker_pids()
    total, piece = 100 * MiB, MiB
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(rss_kib(worker))
            time.sleep(0.05)

    async def run() -> tuple[str, str]:
        sent, received = hashlib.sha256(), hashlib.sha256()
        async with connect(ws_url(gateway, "/echo/big"), max_size=None, compression=None) as ws:
            async def send() -> None:
                for i in range(total // piece):
                    data = os.urandom(16) + bytes([i % 256]) * (piece - 16)
                    sent.update(data)
                    await ws.send(data)

            async def receive() -> None:
                got = 0
                while got < total:
                    message = await ws.recv()
                    assert isinstance(message, bytes)
                    received.update(message)
                    got += len(message)

            await asyncio.gather(send(), receive())
        return sent.hexdigest(), received.hexdigest()

    before = rss_kib(worker)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        sent, received = asyncio.run(run())
    finally:
        done.set()
        sampler.join()
    assert sent == received
    # 200 MiB went through; what the worker holds stays bounded by its buffers, not the traffic
    assert max(samples) - before < 40 * 1024, (before, max(samples))


def test_a_client_that_stops_reading_holds_back_the_upstream_not_the_gateways_memory(
        gateway: GatewayProcess) -> None:
    [worker] = gateway.worker_pids()
    before = rss_kib(worker)
    # the upstream sends 300 MiB as fast as it can; the client reads nothing for a while
    with connect_sync(ws_url(gateway, "/source/300"), max_size=None, max_queue=1) as ws:
        peak = before
        for _ in range(40):
            time.sleep(0.05)
            peak = max(peak, rss_kib(worker))
        assert peak - before < 20 * 1024, (before, peak)
        got = sum(len(message) for message in ws)  # until the upstream's close
    assert got == 300 * MiB  # nothing was lost while it waited


def test_the_handshake_is_limited_and_a_refused_one_never_reaches_the_upstream(
        gateway: GatewayProcess, ws_upstream: WsUpstream) -> None:
    room = f"/limited/{uuid.uuid4().hex}"
    before = ws_upstream.handshakes()
    for _ in range(3):
        with connect_sync(ws_url(gateway, room)) as ws:
            ws.send("in")
            assert ws.recv() == "in"
    with pytest.raises(InvalidStatus) as refused:
        connect_sync(ws_url(gateway, room))
    response = refused.value.response
    assert response.status_code == 429
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.headers["Retry-After"]
    assert ws_upstream.handshakes() - before == 3


def test_a_refused_handshake_answers_and_never_tunnels(gateway: GatewayProcess, ws_upstream: WsUpstream) -> None:
    room = f"/limited/{uuid.uuid4().hex}"
    for _ in range(3):
        with connect_sync(ws_url(gateway, room)):
            pass
    before = ws_upstream.handshakes()
    received = exchange(gateway, handshake(room) + b"GET /plain/after HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 429 "), received[:200]
    assert received.count(b"HTTP/1.1") == 1  # what followed the handshake was neither answered ...
    assert ws_upstream.handshakes() == before  # ... nor forwarded


def test_an_answer_other_than_101_is_an_ordinary_response_and_nothing_after_it_is_tunneled(
        gateway: GatewayProcess) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect_sync(ws_url(gateway, "/refuse"))
    assert refused.value.response.status_code == 403
    assert refused.value.response.body == b"no tunnel here\n"
    received = exchange(gateway, handshake("/refuse") + b"GET /plain/after HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 403 "), received[:200]
    assert received.endswith(b"no tunnel here\n")  # the connection ended with that answer


def test_a_handshake_with_a_body_is_a_400_and_never_reaches_the_upstream(
        gateway: GatewayProcess, ws_upstream: WsUpstream) -> None:
    before = ws_upstream.handshakes()
    for framing, body in (("Content-Length: 5", b"hello"), ("Transfer-Encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n")):
        received = exchange(gateway, handshake("/echo/body", framing) + body)
        assert received.startswith(b"HTTP/1.1 400 "), received[:200]
        assert b"carries no body" in received
    assert ws_upstream.handshakes() == before


@pytest.mark.parametrize(("path", "headers"), [
    ("/echo/h2c", ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__")),
    ("/plain/ws", ("Connection: Upgrade", "Upgrade: websocket", f"Sec-WebSocket-Key: {KEY}",
                   "Sec-WebSocket-Version: 13")),
    ("/echo/post", ("Connection: Upgrade", "Upgrade: websocket", "Content-Length: 0")),
], ids=["h2c-on-a-websocket-route", "websocket-on-a-route-without-it", "websocket-not-a-get"])
def test_other_upgrades_stay_501(gateway: GatewayProcess, ws_upstream: WsUpstream, path: str,
                                 headers: tuple[str, ...]) -> None:
    before = ws_upstream.handshakes()
    method = "POST" if path.endswith("post") else "GET"
    data = "\r\n".join([f"{method} {path} HTTP/1.1", "Host: gw", *headers]) + "\r\n\r\n"
    received = exchange(gateway, data.encode() + b"GET /plain/after HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 501 "), received[:200]
    assert received.count(b"HTTP/1.1") == 1
    assert ws_upstream.handshakes() == before


def test_an_idle_tunnel_is_closed_and_a_busy_one_is_not(gateway: GatewayProcess) -> None:
    with connect_sync(ws_url(gateway, "/idle/echo")) as ws:
        for i in range(6):  # 1.5 idle timeouts of traffic: kept open while bytes flow
            ws.send(str(i))
            assert ws.recv() == str(i)
            time.sleep(0.25)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)  # then silence: closed by the gateway, not by the client's timeout


def test_sigterm_lets_open_tunnels_run_for_the_drain_timeout_then_closes_them(
        tmp_path: Path, redis_proc: RedisProcess, ws_upstream: WsUpstream, upstream: Upstream) -> None:
    proc = start_gateway(tmp_path, redis_proc, ws_upstream, upstream, env={"GATEWAY_DRAIN_TIMEOUT": "3"})
    try:
        with connect_sync(ws_url(proc, "/echo/drain")) as ws:
            ws.send("before")
            assert ws.recv() == "before"
            proc.signal(signal.SIGTERM)
            wait_until(lambda: "shutting down: draining" in proc.log(), timeout=10)
            ws.send("during the drain")  # the tunnel still works after SIGTERM
            assert ws.recv() == "during the drain"
            with pytest.raises(ConnectionClosed):
                echo_until_closed(ws)  # then the gateway closes it
        assert proc.process is not None
        assert proc.process.wait(20) == 0
    finally:
        proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def echo_until_closed(ws: ClientConnection) -> None:
    while True:
        ws.send("x")
        ws.recv(timeout=10)


def test_httpx_own_transport_hands_over_its_network_stream_the_same_way(
        tmp_path: Path, redis_proc: RedisProcess, ws_upstream: WsUpstream, upstream: Upstream) -> None:
    """LeanTransport's `network_stream` is httpcore's interface: with httpx's own transport behind
    the same seam (tests.support.comparison_gateway) the tunnel works unchanged."""
    text = CONFIG.format(prefix=f"w{uuid.uuid4().hex[:8]}", ws=ws_upstream.url, http=upstream.url)
    proc = GatewayProcess(text, tmp_path, redis_url=redis_proc.url, transport="httpx")
    proc.start()
    try:
        with connect_sync(ws_url(proc, "/echo/httpx"), max_size=None) as ws:
            ws.send("hello")
            assert ws.recv() == "hello"
            ws.send(b"b" * MiB)
            assert ws.recv() == b"b" * MiB
        with pytest.raises(InvalidStatus) as refused:
            connect_sync(ws_url(proc, "/refuse"))
        assert refused.value.response.status_code == 403
    finally:
        assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()
