"""The naive forwarder the benchmark compares against: what one writes in an afternoon.

Starlette under uvicorn (one worker), ONE shared `httpx.AsyncClient` for the upstream, and ONE
`EVALSHA` per request through `redis.asyncio` running the gateway's own decision script (written
by gateway/decision_script.py from lua/decide.lua) for the same three rules as the gateway's
benchmark route (token_bucket per user, sliding_window per IP,
gcra global; limits far above the load). So the Redis work per request is identical; what differs
is everything around it.

    UPSTREAM_URL=http://127.0.0.1:9000 REDIS_URL=redis://127.0.0.1:6379 \
        uvicorn naive_forwarder:app --app-dir bench --no-access-log
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.config import Rule
from gateway.decision_script import rule_spec, write_script

UPSTREAM = os.environ.get("UPSTREAM_URL", "http://127.0.0.1:9000").rstrip("/")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
# The same numbers as the gateway's route in bench/run.py; limits far above the load.
RULES = (
    Rule("user", (), "token_bucket", rate=1_000_000.0, burst=1_000_000),
    Rule("ip", (), "sliding_window", limit=1_000_000_000, window=1.0),
    Rule("global", (), "gcra", rate=1_000_000.0, burst=1_000_000),
)
SCRIPT, _ = write_script(tuple(rule_spec(rule) for rule in RULES), peek=False)
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
ARGS = [1, 1, 1]  # the costs
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "content-encoding",
}

state: dict[str, Any] = {}


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    state["client"] = httpx.AsyncClient(timeout=10.0)
    state["redis"] = aioredis.Redis.from_url(REDIS_URL)
    await state["redis"].script_load(SCRIPT)
    yield
    await state["client"].aclose()
    await state["redis"].aclose()


async def forward(request: Request) -> Response:
    ip = request.client.host if request.client else "unknown"
    user = request.headers.get("x-user-id") or ip
    keys = [f"naive:{{bench}}:user:{user}", f"naive:{{bench}}:ip:{ip}", "naive:{bench}:global:_"]
    decision = await state["redis"].evalsha(SHA, len(keys), *keys, *ARGS)
    if decision[0] % 2 != 1:  # the reply's head is odd when admitted (lua/decide.lua)
        return JSONResponse({"title": "Too Many Requests", "status": 429}, status_code=429)
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
    url = UPSTREAM + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    upstream = await state["client"].request(request.method, url, headers=headers, content=await request.body())
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    return Response(upstream.content, status_code=upstream.status_code, headers=out)


app = Starlette(
    routes=[Route("/{path:path}", forward, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])],
    lifespan=lifespan,
)
