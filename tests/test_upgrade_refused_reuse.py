"""Issue 33: the upstream connection that carried an Upgrade the upstream answered with 200 was
reused for the next client's request. Such a connection now ends with its answer."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess


class CountingUpstream:
    """HTTP/1.1 keep-alive upstream that answers everything 200 and counts its connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                _, buffer = buffer.split(b"\r\n\r\n", 1)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def upstream() -> Iterator[CountingUpstream]:
    server = CountingUpstream()
    yield server
    server.close()


def test_a_declined_upgrade_never_lends_its_connection_to_the_next_request(
        tmp_path: Path, redis_proc: RedisProcess, upstream: CountingUpstream) -> None:
    config = f"""\
version: 1
upstreams: {{up: {{url: "http://127.0.0.1:{upstream.port}"}}}}
routes:
  - name: ws
    match: {{path: /ws}}
    upstream: up
    websocket: true
  - name: rest
    match: {{path: "/{{rest:path}}"}}
    upstream: up
"""
    gateway = GatewayProcess(config, tmp_path, redis_url=redis_proc.url)
    gateway.start()
    try:
        assert httpx.get(f"{gateway.url}/a").status_code == 200
        assert httpx.get(f"{gateway.url}/b").status_code == 200
        assert upstream.connections == 1  # kept alive and reused, as usual
        declined = httpx.get(f"{gateway.url}/ws", headers={
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert declined.status_code == 200
        assert httpx.get(f"{gateway.url}/c").status_code == 200
        # the declined upgrade's connection ended with its answer: /c had to open another
        assert upstream.connections == 2
    finally:
        gateway.stop()
