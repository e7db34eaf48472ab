"""The in-process middleware lives the gateway's life (gateway/lifecycle.py): it reloads its file
as `gateway serve` does on SIGHUP, keeping the rules in force when the new file is bad, and each of
its requests is accounted as the proxy's are (an access log line, gateway_requests_total), through
the same request envelope (gateway/envelope.py). A real Redis; the app is a real Starlette app
called in-process."""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import uuid
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway import RateLimitMiddleware, metrics
from tests.support.redis_proc import RedisProcess

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

ROUTES = """
version: 1
access_log: true
redis: {{key_prefix: {prefix}}}
routes:
  - name: {route}
    match: {{path: /data}}
    limits:
      - {{name: user, by: ["header:X-User"], algorithm: fixed_window, limit: {limit}, window: 1h}}
"""


async def data(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/data", data)])


def _write(path: Path, route: str, limit: int, prefix: str) -> None:
    path.write_text(textwrap.dedent(ROUTES.format(route=route, limit=limit, prefix=prefix)))


def _requests_total(route: str, outcome: str) -> float:
    text = metrics.render()[0].decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{") and f'route="{route}"' in line and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_reload_applies_a_changed_file_and_keeps_the_rules_when_the_new_one_is_bad(
        tmp_path: Path, redis_proc: RedisProcess) -> None:
    config, prefix = tmp_path / "routes.yaml", f"ml{uuid.uuid4().hex[:8]}"
    _write(config, "data", 1, prefix)

    async def main() -> list[object]:
        guarded = RateLimitMiddleware(APP, config=str(config), redis_url=redis_proc.url)
        seen: list[object] = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://app") as client:
                async def status() -> int:
                    return (await client.get("/data", headers={"X-User": "u"})).status_code

                seen += [await status(), await status()]          # limit 1: 200, 429
                _write(config, "data", 3, prefix)
                ok, _ = guarded.reload()
                seen += [ok, await status(), await status(), await status()]  # limit 3, 1 spent: 200, 200, 429
                config.write_text("version: 1\nroutes: [{name: data, limits: nope}]\n")
                ok, message = guarded.reload()
                seen += [ok, str(config) in message, await status()]  # still limit 3: 429
                await asyncio.sleep(0)
        finally:
            await guarded.close()
        return seen

    assert asyncio.run(main()) == [200, 429, True, 200, 200, 429, False, True, 429]


def test_each_request_is_accounted_as_the_proxys_are(tmp_path: Path, redis_proc: RedisProcess,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    config, route = tmp_path / "routes.yaml", f"acc{uuid.uuid4().hex[:8]}"
    _write(config, route, 1, f"ma{uuid.uuid4().hex[:8]}")
    refused_before = _requests_total(route, "refused")
    admitted_before = _requests_total(route, "admitted")

    async def main() -> list[int]:
        guarded = RateLimitMiddleware(APP, config=str(config), redis_url=redis_proc.url)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://app") as client:
                return [(await client.get("/data", headers={"X-User": "a"})).status_code for _ in range(3)]
        finally:
            await guarded.close()

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        assert asyncio.run(main()) == [200, 429, 429]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(line["route"], line["decision"], line["status"]) for line in lines] == [
        (route, "admitted", 200), (route, "refused", 429), (route, "refused", 429)]
    assert _requests_total(route, "admitted") - admitted_before == 1
    assert _requests_total(route, "refused") - refused_before == 2
