"""`gateway.RateLimitMiddleware` guarding a real Starlette app and a real FastAPI app, each served
by uvicorn in its own process, against a real Redis: the proxy's decisions,
refusals, headers and failure policy, with admitted requests reaching the app whole."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from gateway.keys import identity_token
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.raw_http import Conn
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_for_port

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 200ms, key_prefix: {prefix}}}
routes:
  - name: orders
    match: {{path: "/orders/{{item}}", methods: [POST]}}
    limits:
      - {{name: user, by: ["header:X-User"], algorithm: fixed_window, limit: 3, window: 1h}}
      - {{name: dedupe, by: ["header:X-User", body], algorithm: sliding_log, limit: 1, window: 1h, status: 409}}
  - name: lookup
    match: {{path: "/seen/get-only/{{rest:path}}", methods: [GET]}}
    limits:
      - {{name: user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 2, window: 1h}}
  - name: seen
    match: {{path: "/seen/{{rest:path}}"}}
    limits:
      - {{name: user, by: ["header:X-User-Id"], on_missing: skip, algorithm: fixed_window, limit: 1, window: 1h}}
  - name: closed
    match: {{path: "/closed"}}
    failure_mode: closed
    limits: [{{name: all, by: [], algorithm: fixed_window, limit: 100, window: 1m}}]
  - name: capped
    match: {{path: "/chat/capped-{{room}}"}}
    limits:
      - {{name: open, by: ["path:room"], algorithm: concurrency, limit: 1}}
  - name: chat
    match: {{path: "/chat/{{room}}"}}
    limits:
      - {{name: room, by: ["path:room"], algorithm: fixed_window, limit: 2, window: 1h}}
  - name: llm
    match: {{path: /v1/completions, methods: [POST]}}
    limits:
      - {{name: tokens, by: ["header:X-User"], algorithm: fixed_window, limit: 1000, window: 1h,
         cost: {{reserve: "request_json:max_tokens", default: 10, settle: "response_json:usage.total_tokens"}}}}
  - name: open
    match: {{path: "/open"}}
    limits: [{{name: all, by: [], algorithm: fixed_window, limit: 100, window: 1m}}]
"""


class Served:
    """`uvicorn tests.support.embedded_apps:<app>` in a subprocess."""

    def __init__(self, app: str, workdir: Path, redis_url: str | None) -> None:
        config = workdir / f"routes-{uuid.uuid4().hex[:6]}.yaml"
        config.write_text(textwrap.dedent(CONFIG.format(prefix=f"m{uuid.uuid4().hex[:8]}")))
        env = {k: v for k, v in os.environ.items() if k != "GATEWAY_REDIS_URL"}
        env["EMBED_CONFIG"] = str(config)
        if redis_url:
            env["EMBED_REDIS_URL"] = redis_url
        self.port = free_port()
        self.log = workdir / f"{app}.log"
        with self.log.open("ab") as log:
            self.process = started(
                [sys.executable, "-m", "uvicorn", f"tests.support.embedded_apps:{app}", "--port", str(self.port),
                 "--lifespan", "on"], env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self.process)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5)

    def stop(self) -> str:
        self.client.close()
        self.process.terminate()
        assert self.process.wait(10) in (0, -15)  # uvicorn re-raises the SIGTERM it handled gracefully
        return self.log.read_text(errors="replace")


@pytest.fixture(params=["starlette_app", "fastapi_app"])
def served(request: pytest.FixtureRequest, tmp_path: Path, redis_proc: RedisProcess) -> Iterator[Served]:
    app = Served(request.param, tmp_path, redis_proc.url)
    yield app
    assert "Traceback" not in app.stop()


def test_limits_refusals_and_headers_are_the_proxys(served: Served) -> None:
    client = served.client
    big = os.urandom(200_000)  # larger than the body digest reads: the app still gets all of it
    for i, body in enumerate([b"a", b"b", big]):
        response = client.post(f"/orders/{i}", content=body, headers={"X-User": "alice"})
        assert response.status_code == 200, response.text
        assert response.json() == {"item": str(i), "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        assert response.headers["ratelimit-policy"]  # the draft fields, as the proxy sends them
    again = client.post("/orders/9", content=b"a", headers={"X-User": "bob"})
    assert again.status_code == 200
    duplicate = client.post("/orders/9", content=b"a", headers={"X-User": "bob"})
    assert duplicate.status_code == 409 and duplicate.json()["rule"] == "dedupe"
    over = client.post("/orders/4", content=b"d", headers={"X-User": "alice"})
    assert over.status_code == 429
    assert over.headers["content-type"] == "application/problem+json"
    assert int(over.headers["retry-after"]) > 0 and over.json()["rule"] == "user"
    missing = client.post("/orders/5", content=b"e")
    assert missing.status_code == 400 and missing.json()["rule"] == "user"


def test_head_and_method_overrides_are_counted_as_the_method_the_app_acts_on(served: Served) -> None:
    """The app serves HEAD with its GET handler, and a framework honouring X-HTTP-Method-Override
    runs the GET handler for that POST: both are counted as GET (before: passed to the app unlimited)."""
    who = {"X-User-Id": f"u{uuid.uuid4().hex}"}
    assert served.client.head("/seen/get-only/a", headers=who).status_code != 429
    assert served.client.get("/seen/get-only/a", headers=who).status_code == 200
    assert served.client.get("/seen/get-only/a", headers=who).status_code == 429  # the HEAD took one of two
    assert served.client.head("/seen/get-only/a", headers=who).status_code == 429
    overridden = served.client.post("/seen/get-only/a", headers={**who, "X-HTTP-Method-Override": "GET"})
    assert overridden.status_code == 429


def test_an_override_naming_a_method_no_route_takes_does_not_reach_the_app_uncounted(served: Served) -> None:
    """POST /orders/N is limited and no route takes PUT there: a POST naming PUT went to the app
    as "no route", and an app that honours no override ran its POST handler, uncounted."""
    who = {"X-User": f"u{uuid.uuid4().hex}"}
    for i in range(3):
        assert served.client.post(f"/orders/{i}", content=str(i).encode(), headers=who).status_code == 200
    assert served.client.post("/orders/3", content=b"y", headers=who).status_code == 429
    walked = served.client.post("/orders/4", content=b"z", headers={**who, "X-HTTP-Method-Override": "PUT"})
    assert walked.status_code == 400, walked.text  # before: 200, from the app's POST handler
    assert "may act on either" in walked.json()["detail"]


def test_an_app_mounted_under_a_path_is_limited_by_the_paths_its_routes_name(tmp_path: Path,
                                                                            redis_proc: RedisProcess) -> None:
    """Under Starlette's Mount (or a server's --root-path) an app routes on the path less root_path:
    before, the middleware matched the whole path, no route of routes.yaml matched, and every
    request reached the app unlimited (an outside probe)."""
    served = Served("mounted_app", tmp_path, redis_proc.url)
    try:
        who = {"X-User": f"u{uuid.uuid4().hex}"}
        for i in range(3):
            answer = served.client.post(f"/shop/orders/{i}", content=str(i).encode(), headers=who)
            assert answer.status_code == 200 and answer.json()["item"] == str(i), answer.text
        assert served.client.post("/shop/orders/3", content=b"3", headers=who).status_code == 429
        # a path the limiter normalizes reaches the app under its mount still
        answer = served.client.post("/shop/./orders/%34", content=b"4", headers={"X-User": f"v{uuid.uuid4().hex}"})
        assert answer.status_code == 200 and answer.json()["item"] == "4", answer.text
    finally:
        assert "Traceback" not in served.stop()


def test_the_app_sees_the_request_the_limiter_decided_on(served: Served) -> None:
    def raw(request: bytes) -> tuple[int, bytes]:
        with Conn(served.port) as conn:
            conn.send(request)
            status, _, body = conn.response()
            return status, body

    # a field named in Connection is no identity, so the app must not see it either
    hidden = b"GET /seen/x/../y HTTP/1.1\r\nHost: a\r\nConnection: x-user-id\r\nX-User-Id: alice\r\n\r\n"
    for _ in range(2):
        status, body = raw(hidden)
        assert status == 200
        assert json.loads(body)["path"] == "/seen/y"  # the normalized path the route matched
        assert "x-user-id" not in json.loads(body)["headers"]
    plain = b"GET /seen/z HTTP/1.1\r\nHost: a\r\nX-User-Id: alice\r\n\r\n"
    assert [raw(plain)[0] for _ in range(2)] == [200, 429]
    # an empty chunked body read for the body identity still reaches the app, whole
    empty = b"POST /orders/7 HTTP/1.1\r\nHost: a\r\nX-User: carol\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    status, body = raw(empty)
    assert status == 200 and json.loads(body)["length"] == 0


def test_requests_no_route_matches_pass_to_the_app_unlimited(served: Served) -> None:
    for _ in range(5):
        response = served.client.get("/free")
        assert response.status_code == 200 and response.text == "/free"
        assert "ratelimit-policy" not in response.headers
    # a path a route owns under POST only: the app answers, as it would without the middleware
    assert served.client.get("/orders/1").status_code == 405
    # what the proxy refuses before matching is refused here only where a route could apply
    for path in (b"/fr;ee", b"/free"):
        with Conn(served.port) as conn:
            conn.send(b"GET " + path + b" HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
            status, _, body = conn.response()
        assert (status, body) == (200, path), "the app's own request"
    with Conn(served.port) as conn:
        conn.send(b"GET /seen/x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        assert conn.response()[0] == 501, "a route's request: refused as the proxy refuses it"
    with Conn(served.port) as conn:
        conn.send(b"GET /seen/a;b HTTP/1.1\r\nHost: a\r\n\r\n")
        assert conn.response()[0] == 400


def test_redis_unavailable_follows_each_routes_failure_mode(tmp_path: Path) -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}"
    for app_name in ("starlette_app", "fastapi_app"):
        app = Served(app_name, tmp_path, unreachable)
        try:
            assert app.client.get("/open").text == "/open"
            closed = app.client.get("/closed")
            assert closed.status_code == 503 and closed.headers["retry-after"] == "1"
        finally:
            assert "Traceback" not in app.stop()


def test_without_a_redis_url_it_starts_its_own_redis(tmp_path: Path) -> None:
    app = Served("starlette_app", tmp_path, None)
    try:
        statuses = [app.client.post(f"/orders/{i}", content=str(i).encode(), headers={"X-User": "u"}).status_code
                    for i in range(4)]
        assert statuses == [200, 200, 200, 429]
    finally:
        assert "Traceback" not in app.stop()


def test_a_bad_file_fails_the_apps_startup_not_its_requests(tmp_path: Path) -> None:
    """A typo under RateLimitMiddleware: uvicorn (lifespan "auto", its default) exits with the errors
    at start-up, instead of serving every request a 500."""
    config = tmp_path / "limits.yaml"
    config.write_text(textwrap.dedent("""\
        version: 1
        routes:
          - name: orders
            match: {path: "/orders/{item}"}
            limits:
              - {name: user, by: ["header:X-User"], algorithm: fixed_window, limit: 3, windw: 1h}
        """))
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_REDIS_URL"}
    env["EMBED_CONFIG"] = str(config)
    result = subprocess.run(
        [sys.executable, "-m", "uvicorn", "tests.support.embedded_apps:starlette_app", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert f"{config}:6: " in result.stderr and "windw" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "appears unsupported" not in result.stderr


def test_websocket_handshakes_are_limited_and_a_refused_one_is_answered_429(tmp_path: Path,
                                                                           redis_proc: RedisProcess) -> None:
    """uvicorn supports `websocket.http.response`: the refusal is the proxy's 429, never the app's."""
    app = Served("starlette_app", tmp_path, redis_proc.url)
    try:
        url = f"ws://127.0.0.1:{app.port}/chat/{uuid.uuid4().hex}"
        for _ in range(2):
            with connect(url) as ws:
                ws.send("hello")
                assert ws.recv() == "hello"
                assert ws.response is not None
                assert ws.response.headers["RateLimit-Policy"] == '"room";q=2;w=3600'
        with pytest.raises(InvalidStatus) as refused:
            connect(url)
        response = refused.value.response
        assert response.status_code == 429
        assert response.headers["Content-Type"] == "application/problem+json"
        assert json.loads(response.body)["rule"] == "room"
    finally:
        assert "Traceback" not in app.stop()


def test_a_refused_websocket_is_closed_with_1008_where_the_server_cannot_answer_it(
        tmp_path: Path, redis_proc: RedisProcess) -> None:
    app = Served("starlette_app_without_http_response", tmp_path, redis_proc.url)
    try:
        url = f"ws://127.0.0.1:{app.port}/chat/{uuid.uuid4().hex}"
        for _ in range(2):
            with connect(url) as ws:
                ws.send("hello")
                assert ws.recv() == "hello"
        with connect(url) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1008
        assert "rate limit 'room' of route 'chat' exceeded" in closed.value.rcvd.reason
    finally:
        assert "Traceback" not in app.stop()


def test_a_websocket_holds_its_concurrency_slot_until_it_closes(tmp_path: Path, redis_proc: RedisProcess) -> None:
    app = Served("starlette_app", tmp_path, redis_proc.url)
    try:
        url = f"ws://127.0.0.1:{app.port}/chat/capped-{uuid.uuid4().hex}"
        with connect(url) as ws:
            ws.send("hello")
            assert ws.recv() == "hello"
            with pytest.raises(InvalidStatus) as refused:  # the one slot is held while the socket is open
                connect(url)
            assert refused.value.response.status_code == 429
            assert json.loads(refused.value.response.body)["rule"] == "open"
        for _ in range(3):  # closed: given back, every time
            deadline = time.monotonic() + 5
            while True:
                try:
                    with connect(url) as again:
                        again.send("back")
                        assert again.recv() == "back"
                    break
                except InvalidStatus:
                    assert time.monotonic() < deadline, "the slot never came back"
                    time.sleep(0.05)
    finally:
        assert "Traceback" not in app.stop()


def test_a_token_budget_settles_by_the_apps_answer(served: Served, redis_proc: RedisProcess) -> None:
    """In-process too: the reserve at admission, the app's usage (JSON or SSE) settled when it ends."""
    client = served.client
    user = f"u{uuid.uuid4().hex[:8]}"
    plain = client.post("/v1/completions", json={"max_tokens": 300, "used": 40}, headers={"X-User": user})
    assert plain.status_code == 200
    streamed = client.post("/v1/completions", json={"max_tokens": 100, "used": 250, "stream": True},
                           headers={"X-User": user})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    redis = redis_proc.client()
    token = identity_token([user.encode()], readable=False)  # a header's value: keyed by its digest
    deadline = time.monotonic() + 10
    count = None
    while time.monotonic() < deadline:  # the settlements go in the background: 40 + 250 charged in all
        keys = list(redis.scan_iter(match=f"*{{llm}}:tokens:{token}"))
        count = int(redis.get(keys[0]) or 0) if keys else None
        if count == 290:
            break
        time.sleep(0.05)
    assert count == 290
