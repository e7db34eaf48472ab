"""gateway/pipeline.py: one request in, a typed result out (Admit or Answer), against a real Redis.
The proxy endpoint, the middleware and the server's early path all take this way."""

from __future__ import annotations

import asyncio
import json
import textwrap
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Config, load_config
from gateway.outcome import Admit, Answer, DecidedBy, RequestBounds, RequestOutcome
from gateway.pipeline import decide, decide_now
from gateway.runtime import Runtime, build_runtime, new_limiter
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{timeout: 200ms, key_prefix: {prefix}}}
routes:
  - name: orders
    match: {{path: "/orders/{{item}}", methods: [POST]}}
    limits:
      - {{name: user, by: ["header:X-User"], algorithm: fixed_window, limit: 2, window: 1h}}
      - {{name: dedupe, by: ["header:X-User", body], algorithm: sliding_log, limit: 1, window: 1h, status: 409}}
  - name: ping
    match: {{path: "/ping"}}
    limits: [{{name: user, by: ["header:X-User"], algorithm: fixed_window, limit: 1, window: 1h}}]
  - name: closed
    match: {{path: "/closed"}}
    failure_mode: closed
    limits: [{{name: all, by: [], algorithm: fixed_window, limit: 100, window: 1m}}]
  - name: open
    match: {{path: "/open"}}
    limits: [{{name: all, by: [], algorithm: fixed_window, limit: 100, window: 1m}}]
"""
LIMITS = RequestBounds()


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "routes.yaml"
    path.write_text(textwrap.dedent(CONFIG.format(prefix=f"p{uuid.uuid4().hex[:8]}")))
    return load_config(path, proxy=False)


Check = Callable[[Runtime], Awaitable[None]]


def on_runtime(config: Config, url: str, check: Check) -> None:
    """Run `check` on a runtime of `config` on one event loop (the Redis connections belong to it)."""
    async def run() -> None:
        redis = replace(config.redis, url=url)
        runtime = build_runtime(config, redis, new_limiter(redis))
        try:
            await check(runtime)
        finally:
            await runtime.limiter.close()

    asyncio.run(run())


def scope(method: str, path: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"host", b"gw"), *headers], "client": ("10.0.0.1", 5000), "http_version": "1.1"}


def body(data: bytes) -> Any:
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def order(user: bytes, data: bytes) -> tuple[dict[str, Any], Any]:
    return scope("POST", "/orders/1", (b"x-user", user), (b"content-length", b"%d" % len(data)),
                 (b"x-request-id", b"rid-1")), body(data)


async def run(runtime: Runtime, request: tuple[dict[str, Any], Any]) -> Admit | Answer:
    return await decide(runtime, request[0], request[1], LIMITS)


def test_admitted_then_refused_by_the_rule_that_is_spent(config: Config, redis_proc: RedisProcess) -> None:
    on_runtime(config, redis_proc.url, admitted_then_refused)


async def admitted_then_refused(runtime: Runtime) -> None:
    first = await run(runtime, order(b"alice", b"a"))
    assert isinstance(first, Admit) and first.outcome is RequestOutcome.ADMITTED
    assert first.body_prefix == b"a" and not first.more_body  # read for the body identity: forwarded first
    assert (b"ratelimit-policy", b'"dedupe";q=1;w=3600, "user";q=2;w=3600') in first.headers
    duplicate = await run(runtime, order(b"alice", b"a"))
    assert isinstance(duplicate, Answer) and (duplicate.status, duplicate.rule) == (409, "dedupe")
    assert duplicate.outcome is RequestOutcome.REFUSED and duplicate.request_id == b"rid-1"
    assert isinstance(await run(runtime, order(b"alice", b"b")), Admit)
    spent = await run(runtime, order(b"alice", b"c"))
    assert isinstance(spent, Answer) and (spent.status, spent.rule, spent.route) == (429, "user", "orders")
    assert any(name == b"retry-after" for name, _ in spent.headers)


def test_the_early_path_answers_only_refusals_held_in_memory(config: Config, redis_proc: RedisProcess) -> None:
    on_runtime(config, redis_proc.url, early_path)


async def early_path(runtime: Runtime) -> None:
    ping = scope("GET", "/ping", (b"x-user", b"dave"))
    assert decide_now(runtime, ping, LIMITS) is None
    assert isinstance(await run(runtime, (ping, body(b""))), Admit)
    refused = await run(runtime, (ping, body(b"")))
    assert isinstance(refused, Answer) and refused.outcome is RequestOutcome.REFUSED
    early = decide_now(runtime, ping, LIMITS)  # held: answered without Redis, before any app
    assert early is not None and early.outcome is RequestOutcome.REFUSED and early.decided_by is DecidedBy.MEMORY
    assert (early.status, early.rule, json.loads(early.body)["route"]) == (429, "user", "ping")
    assert decide_now(runtime, scope("GET", "/ping", (b"x-user", b"erin")), LIMITS) is None
    request = scope("POST", "/orders/2", (b"x-user", b"bob"), (b"content-length", b"0"))
    assert decide_now(runtime, request, LIMITS) is None  # nothing held yet: the whole way
    for data in (b"1", b"2"):
        assert isinstance(await run(runtime, order(b"bob", data)), Admit)
    assert isinstance(await run(runtime, order(b"bob", b"3")), Answer)  # Redis refused: now held
    # a body identity is never answered early: its body is not read there
    assert decide_now(runtime, scope("POST", "/orders/2", (b"x-user", b"bob"), (b"content-length", b"1")),
                      LIMITS) is None


def test_answers_before_any_limit(config: Config, redis_proc: RedisProcess) -> None:
    on_runtime(config, redis_proc.url, answers_before_any_limit)


async def answers_before_any_limit(runtime: Runtime) -> None:
    missing = await run(runtime, (scope("POST", "/orders/3", (b"content-length", b"0")), body(b"")))
    assert isinstance(missing, Answer) and (missing.status, missing.rule) == (400, "user")
    assert missing.outcome is RequestOutcome.BAD_REQUEST
    wrong_method = await run(runtime, (scope("GET", "/orders/3"), body(b"")))
    assert isinstance(wrong_method, Answer) and wrong_method.outcome is RequestOutcome.METHOD_NOT_ALLOWED
    assert (b"allow", b"POST") in wrong_method.headers and wrong_method.route == ""
    nowhere = await run(runtime, (scope("GET", "/nowhere"), body(b"")))
    assert isinstance(nowhere, Answer) and (nowhere.status, nowhere.outcome) == (404, RequestOutcome.NO_ROUTE)
    ambiguous = await run(runtime, (scope("GET", "/open", (b"host", b"second")), body(b"")))
    assert isinstance(ambiguous, Answer) and ambiguous.status == 400 and ambiguous.close


def test_redis_unavailable_follows_the_routes_failure_mode(config: Config) -> None:
    async def check(runtime: Runtime) -> None:
        opened = await run(runtime, (scope("GET", "/open"), body(b"")))
        assert isinstance(opened, Admit) and opened.outcome is RequestOutcome.FAILED_OPEN
        closed = await run(runtime, (scope("GET", "/closed"), body(b"")))
        assert isinstance(closed, Answer) and closed.outcome is RequestOutcome.FAILED_CLOSED
        assert (closed.status, dict(closed.headers)[b"retry-after"]) == (503, b"1")

    on_runtime(config, f"redis://127.0.0.1:{free_port()}", check)


def test_a_client_gone_while_its_body_is_read_is_no_decision(config: Config, redis_proc: RedisProcess) -> None:
    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def check(runtime: Runtime) -> None:
        request = scope("POST", "/orders/5", (b"x-user", b"carol"), (b"content-length", b"10"))
        result = await decide(runtime, request, gone, LIMITS)
        assert isinstance(result, Answer) and result.outcome is RequestOutcome.CLIENT_GONE

    on_runtime(config, redis_proc.url, check)
