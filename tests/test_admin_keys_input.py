"""The admin port's /keys takes a key as the bytes the client will send, tells a raw key from a
fingerprint, and answers a stalled body or an impossible cursor with a clear 4xx, never a 500/503."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.admin.common import ADMIN_BODY_TIMEOUT
from gateway.api_keys import digest, fingerprint
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "header:X-Api-Key", plans: [free, pro]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api
    match: {{path: /echo/api}}
    upstream: up
    limits: [{{name: per-key, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 100, window: 1m}}]
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    config = CONFIG.format(prefix=f"k{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    process = GatewayProcess(config, Path(tmp_path_factory.mktemp("admin-keys")), redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        assert "Traceback" not in process.log(), process.log()


def _status(gateway: GatewayProcess, key: bytes) -> int:
    return httpx.get(gateway.url + "/echo/api", headers={b"X-Api-Key": key}).status_code


def test_a_key_with_a_byte_outside_utf8_matches_the_byte_the_client_sends(gateway: GatewayProcess) -> None:
    key = b"\xff" + uuid.uuid4().hex.encode()
    put = httpx.put(f"{gateway.admin_url}/keys?key=%FF{key[1:].decode()}", json={"plan": "free"})
    assert put.status_code == 200 and put.json()["key"] == fingerprint(digest(key))
    wait_until(lambda: _status(gateway, key) == 200, timeout=2.0)
    latin = "\u00ff" + key[1:].decode()  # the same character as UTF-8 is another key
    assert _status(gateway, latin.encode()) == 401


def test_a_raw_key_shaped_like_a_fingerprint_is_revoked_by_its_own_value(gateway: GatewayProcess) -> None:
    raw = "kf_" + uuid.uuid4().hex[:16]
    with httpx.Client(base_url=gateway.admin_url) as admin:
        assert admin.put("/keys", params={"key": raw}, json={"plan": "pro"}).status_code == 200
        mark = fingerprint(digest(raw.encode()))
        assert admin.get("/keys", params={"key": raw}).json() == {"key": mark, "plan": "pro", "consumer": mark,
                                                                  "metadata": {}}
        wait_until(lambda: _status(gateway, raw.encode()) == 200, timeout=2.0)
        assert admin.delete("/keys", params={"key": raw}).status_code == 200
        assert admin.get("/keys", params={"key": raw}).status_code == 404
        wait_until(lambda: _status(gateway, raw.encode()) == 401, timeout=2.0)
        # a fingerprint still names the key it stands for
        other = uuid.uuid4().hex
        assert admin.put("/keys", params={"key": other}, json={"plan": "free"}).status_code == 200
        mark = fingerprint(digest(other.encode()))
        assert admin.get("/keys", params={"key": mark}).json()["plan"] == "free"
        assert admin.delete("/keys", params={"key": mark}).status_code == 200


def _answer(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_a_stalled_put_body_is_a_408(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.admin_port)) as sock:
        sock.sendall(b"PUT /keys?key=stalled HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"plan": ')
        started = time.monotonic()
        reply = _answer(sock, ADMIN_BODY_TIMEOUT + 5)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
        assert b"application/problem+json" in reply
        assert time.monotonic() - started < ADMIN_BODY_TIMEOUT + within(4)


@pytest.mark.parametrize("cursor", ["9" * 30, str(2**64), "18446744073709551616000"])
def test_an_impossible_cursor_is_a_400_naming_it(gateway: GatewayProcess, cursor: str) -> None:
    with httpx.Client(base_url=gateway.admin_url) as admin:
        for path, params in (("/keys", {"plan": "free", "cursor": cursor}),
                             ("/overrides", {"cursor": f"0.{cursor}"}),
                             ("/overrides/api/per-key", {"cursor": cursor})):
            answer = admin.get(path, params=params)
            assert answer.status_code == 400, (path, answer.status_code, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert "cursor" in answer.json()["detail"], answer.text


@pytest.mark.parametrize(("method", "path", "body"), [
    ("PUT", "/keys?key=m1", b'{"plan": "free", "metadata": {"email": "\\ud800"}}'),
    ("POST", "/keys", b'{"keys": [{"key": "m2", "plan": "free", "metadata": {"e": "\\udcff"}}]}'),
    ("POST", "/keys", b'{"keys": [{"key": "\\ud800", "plan": "free"}]}'),
    ("PUT", "/overrides/api/per-key?key=m3", b'{"limit": 5, "\\ud800": 1}'),
])
def test_an_escaped_lone_surrogate_is_a_400_and_writes_nothing(gateway: GatewayProcess, method: str, path: str,
                                                               body: bytes) -> None:
    """JSON lets "\\ud800" through, but it is no text: it failed where the value was encoded, a 500
    (an outside probe)."""
    answer = httpx.request(method, gateway.admin_url + path, content=body,
                           headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert "lone surrogate" in answer.json()["detail"]
    for key in ("m1", "m2", "m3"):
        assert httpx.get(gateway.admin_url + "/keys", params={"key": key}).status_code == 404


COOKIE_KEYS = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
keys: {{source: "cookie:session_key", plans: [free]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api
    match: {{path: /echo/api}}
    upstream: up
    limits: [{{name: per-key, by: ["cookie:session_key"], algorithm: fixed_window, limit: 100, window: 1m}}]
"""


def test_a_key_read_from_a_cookie_matches_the_key_as_issued(tmp_path: Path, redis_proc: RedisProcess,
                                                            upstream: Upstream) -> None:
    """A cookie's quotes and percent-escapes are decoded as frameworks decode them: a key holding
    %41 or quotes, registered as issued and sent so, was never found (401; an outside probe)."""
    gateway = GatewayProcess(COOKIE_KEYS.format(prefix=f"c{uuid.uuid4().hex[:8]}", upstream=upstream.url),
                             tmp_path, redis_url=redis_proc.url)
    gateway.start()
    try:
        issued = ["p%41" + uuid.uuid4().hex, '"q' + uuid.uuid4().hex + '"', "plain" + uuid.uuid4().hex]
        for key in issued:
            assert httpx.put(gateway.admin_url + "/keys", params={"key": key}, json={"plan": "free"}).status_code == 200

        def admitted(key: str) -> bool:
            return httpx.get(gateway.url + "/echo/api", headers={"Cookie": f"session_key={key}"}).status_code == 200

        wait_until(lambda: all(admitted(key) for key in issued), timeout=2.0)
        assert httpx.get(gateway.url + "/echo/api", headers={"Cookie": "session_key=unknown"}).status_code == 401
        assert httpx.put(gateway.admin_url + "/keys", params={"key": '""'}, json={"plan": "free"}).status_code == 400
    finally:
        assert gateway.stop() == 0
