"""Hostile clients against a real gateway: malformed, oversized, ambiguous, slow, and random.

Every outcome is a clean answer (problem+json from the gateway, or the upstream's own answer),
never a 500, never a request forwarded ambiguously, never a crashed worker.
"""

from __future__ import annotations

import contextlib
import json
import socket
import string
import uuid
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

CONFIG = """
version: 1
redis: {{timeout: 200ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}", timeout: 2s}}
routes:
  - name: keyed
    match: {{path: "/echo/keyed/{{item}}"}}
    upstream: up
    limits:
      - {{name: user, by: [header:X-User], algorithm: gcra, rate: 1000/s, burst: 1000, on_missing: skip}}
      - {{name: item, by: [path:item, query:q, cookie:c], algorithm: sliding_window, limit: 100000,
          window: 1s, on_missing: ip}}
      - {{name: any, by: [header:X-Cost-Key], algorithm: token_bucket, rate: 100/s, burst: 1000,
          cost: "header:X-Cost", on_missing: skip}}
  - name: rest
    match: {{path: "/{{rest:path}}"}}
    upstream: up
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    text = CONFIG.format(prefix=f"h{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    proc = GatewayProcess(text, tmp_path_factory.mktemp("hostile"), redis_url=redis_proc.url,
                          env={"GATEWAY_HEADER_TIMEOUT": "1", "GATEWAY_BODY_TIMEOUT": "1"})
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


def exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send raw bytes; return everything the gateway answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
            if _complete(out):
                break
        return out


def _complete(raw: bytes) -> bool:
    """A whole response with a Content-Length has arrived (keep-alive would otherwise idle on)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def body_json(raw: bytes) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/problem+json" in head.lower()
    return json.loads(body)  # type: ignore[no-any-return]


@pytest.mark.parametrize("request_bytes", [
    b"POST /echo/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /echo/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello!!",
    b"POST /echo/x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
    b"POST /echo/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked, identity\r\n\r\n0\r\n\r\n",
    b"GET /echo/\x00x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
    b"GET /echo/x HTTP/1.1\r\nBad Header Name: x\r\n\r\n",
], ids=["cl-and-te", "two-content-lengths", "negative-length", "te-not-chunked-last", "nul-in-path",
        "tls-to-plain-port", "space-in-header-name"])
def test_ambiguous_or_malformed_requests_are_refused_not_forwarded(
    gateway: GatewayProcess, request_bytes: bytes
) -> None:
    raw = exchange(gateway.port, request_bytes)
    assert status_of(raw) == 400
    assert body_json(raw)["status"] == 400


def test_oversized_head_is_431_and_long_url_is_414(gateway: GatewayProcess) -> None:
    huge_header = b"GET /echo/x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n"
    assert status_of(exchange(gateway.port, huge_header)) == 431
    many_headers = b"GET /echo/x HTTP/1.1\r\nHost: a\r\n" + b"X-H: 0123456789\r\n" * 8000 + b"\r\n"
    assert status_of(exchange(gateway.port, many_headers)) == 431
    long_url = b"GET /echo/" + b"u" * (20 * 1024) + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    assert status_of(exchange(gateway.port, long_url)) == 414


def test_slow_headers_are_cut_off(gateway: GatewayProcess) -> None:
    raw = exchange(gateway.port, b"GET /echo/x HTTP/1.1\r\nHost: a\r\nX-Slow: ", wait=10)
    assert status_of(raw) == 408
    assert "headers" in str(body_json(raw)["detail"])


def test_stalled_body_is_408_and_upstream_sees_nothing_complete(gateway: GatewayProcess) -> None:
    raw = exchange(gateway.port, b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly-part", wait=10)
    assert status_of(raw) == 408


def test_identity_of_a_megabyte_is_refused_cleanly(gateway: GatewayProcess) -> None:
    # within the 64 KiB head bound but far over identity.max_length (1024 bytes)
    raw = exchange(gateway.port, b"GET /echo/keyed/1 HTTP/1.1\r\nHost: a\r\nX-User: " + b"u" * 60000 + b"\r\n\r\n")
    assert status_of(raw) == 400
    assert "longer than" in str(body_json(raw)["detail"])


def test_gateway_still_serves_after_the_abuse(gateway: GatewayProcess) -> None:
    assert httpx.get(gateway.url + "/echo/fine").status_code == 200
    assert httpx.get(gateway.admin_url + "/healthz").status_code == 200


header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)
path_segment = st.text(alphabet=string.ascii_letters + string.digits + "-._~%!$&'()*+,;=:@", min_size=0, max_size=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    segments=st.lists(path_segment, min_size=1, max_size=5),
    query=st.text(alphabet=string.printable.strip(), max_size=60),
    user=header_text,
    cost_key=st.one_of(st.none(), header_text),
    cost=st.one_of(st.none(), st.text(alphabet="0123456789-+x ", max_size=12)),
    cookie=header_text,
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]),
)
def test_random_requests_get_a_clean_answer(
    gateway: GatewayProcess, segments: list[str], query: str, user: str, cost_key: str | None,
    cost: str | None, cookie: str, method: str,
) -> None:
    path = "/echo/keyed/" + "/".join(segments)
    headers = {"X-User": user, "Cookie": cookie}
    if cost_key is not None:
        headers["X-Cost-Key"] = cost_key
    if cost is not None:
        headers["X-Cost"] = cost
    try:
        request = httpx.Request(method, gateway.url + path, params=None, headers=headers)
        request.url = request.url.copy_with(query=query.encode("ascii", "ignore") or None)
    except (httpx.InvalidURL, httpx.LocalProtocolError, ValueError):
        return  # the client library itself refuses to send it
    try:
        with httpx.Client(timeout=10) as client:
            response = client.send(request)
    except httpx.LocalProtocolError:
        return
    assert response.status_code != 500
    assert response.status_code in (200, 400, 404, 414, 429, 431), response.text
    if response.status_code != 200:
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == response.status_code
