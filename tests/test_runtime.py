"""The end of a runtime (gateway/runtime.py, `Runtime.close`), for every entry point: an app that
embeds the middleware and stops right after its last answers loses no refund and no concurrency
slot (issue 32: the middleware's close skipped the drains the gateway's lifespan did)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from gateway import RateLimitMiddleware
from tests.support.redis_proc import RedisProcess

CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
routes:
  - name: refunded
    match: {{path: /refunded}}
    limits: [{{name: q, by: [], algorithm: quota, limit: 100, refund_on: [5xx]}}]
  - name: slots
    match: {{path: /slots}}
    limits: [{{name: c, by: [], algorithm: concurrency, limit: 100}}]
"""


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].removeprefix("lifespan.")
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    status = 500 if scope["path"] == "/refunded" else 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_the_middleware_stopping_right_after_its_answers_loses_no_refund_and_no_slot(
        tmp_path: Path, redis_proc: RedisProcess) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    config = tmp_path / "routes.yaml"
    config.write_text(CONFIG.format(prefix=prefix))

    async def main() -> None:
        guarded = RateLimitMiddleware(app, config=str(config), redis_url=redis_proc.url)
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        started = asyncio.Event()

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set()

        lifespan = asyncio.ensure_future(guarded({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send))
        await inbox.put({"type": "lifespan.startup"})
        await asyncio.wait_for(started.wait(), 30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://app") as client:
            answers = await asyncio.gather(*[client.get(path) for path in ["/refunded"] * 20 + ["/slots"] * 20])
        assert [a.status_code for a in answers] == [500] * 20 + [200] * 20
        await inbox.put({"type": "lifespan.shutdown"})  # at once: refunds and releases still queued
        await lifespan

    asyncio.run(main())
    redis = redis_proc.client()
    quota = [k for k in redis.keys(f"{prefix}:{{refunded}}:*")]
    assert quota and all(int(redis.get(k) or 0) == 0 for k in quota), "every 5xx was refunded"
    slots = [k for k in redis.keys(f"{prefix}:{{slots}}:*")]
    assert all(redis.zcard(k) == 0 for k in slots if redis.type(k) == b"zset"), "every slot was given back"
