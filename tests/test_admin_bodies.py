"""Issue 33: the admin port read a 64 MiB body whole before its 413, and waited for a stalled body
for ever. Now a declared length past the bound is refused before the body is read, a body that
grows past it is cut there, and one that stalls is a 408 (gateway/admin/, ADMIN_BODY_TIMEOUT)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gateway.admin.common import ADMIN_BODY_TIMEOUT
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """\
version: 1
upstreams: {{up: {{url: "{url}"}}}}
routes:
  - name: api
    match: {{path: "/{{rest:path}}"}}
    upstream: up
    limits: [{{name: user, by: [header:X-User], algorithm: fixed_window, limit: 5, window: 1m}}]
"""
PUT = b"PUT /overrides/api/user?key=alice HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    process = GatewayProcess(CONFIG.format(url=upstream.url), tmp_path_factory.mktemp("admin-bodies"),
                             redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        assert "Traceback" not in process.log(), process.log()


def answer(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_a_declared_length_past_the_bound_is_refused_before_the_body(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.admin_port)) as sock:
        sock.sendall(PUT + b"Content-Length: 67108864\r\n\r\n")  # 64 MiB announced, none sent
        started = time.monotonic()
        reply = answer(sock, 5)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert time.monotonic() - started < within(3)


def test_a_chunked_body_growing_past_the_bound_is_cut_there(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.admin_port)) as sock:
        sock.sendall(PUT + b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            sock.sendall(b"800\r\n" + b" " * 0x800 + b"\r\n")  # 6 KiB, more than the 4 KiB bound
        reply = answer(sock, 5)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_a_stalled_body_is_a_408(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.admin_port)) as sock:
        sock.sendall(PUT + b"Content-Length: 100\r\n\r\n" + b'{"limit": ')
        started = time.monotonic()
        reply = answer(sock, ADMIN_BODY_TIMEOUT + 5)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert ADMIN_BODY_TIMEOUT - 0.5 <= time.monotonic() - started < ADMIN_BODY_TIMEOUT + within(4)


