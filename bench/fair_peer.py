"""The fair peer the benchmark compares against: what a careful engineer builds on the same stack
in a day, minus httpx's pathological AsyncClient (encode/httpx#3215).

Starlette under uvicorn (one worker, uvloop and httptools), ONE shared aiohttp `ClientSession`
for the upstream, and ONE `EVALSHA` per request through `redis.asyncio` (hiredis parser) running
the gateway's own decision script (written by gateway/decision_script.py from lua/decide.lua) for
the same three rules as the gateway's benchmark route (token_bucket per user, sliding_window per
IP, gcra global; limits far above the load). The Redis work per request is identical; what
differs is everything around it.

    UPSTREAM_URL=http://127.0.0.1:9000 REDIS_URL=redis://127.0.0.1:6379 \\
        uvicorn fair_peer:app --app-dir bench --loop uvloop --http httptools --no-access-log
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from naive_forwarder import ARGS, HOP_BY_HOP, SCRIPT, SHA  # the same script, keys and costs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

UPSTREAM = os.environ.get("UPSTREAM_URL", "http://127.0.0.1:9000").rstrip("/")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")

state: dict[str, Any] = {}


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    state["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512), auto_decompress=False)
    state["redis"] = aioredis.Redis.from_url(REDIS_URL, max_connections=512)
    await state["redis"].script_load(SCRIPT)
    yield
    await state["client"].close()
    await state["redis"].aclose()


async def forward(request: Request) -> Response:
    ip = request.client.host if request.client else "unknown"
    user = request.headers.get("x-user-id") or ip
    keys = [f"peer:{{bench}}:user:{user}", f"peer:{{bench}}:ip:{ip}", "peer:{bench}:global:_"]
    decision = await state["redis"].evalsha(SHA, len(keys), *keys, *ARGS)
    if decision[0] % 2 != 1:  # the reply's head is odd when admitted (lua/decide.lua)
        return JSONResponse({"title": "Too Many Requests", "status": 429}, status_code=429)
    headers = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
    headers["x-forwarded-for"] = ip
    url = UPSTREAM + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    body = await request.body()
    async with state["client"].request(request.method, url, headers=headers, data=body or None) as upstream:
        content = await upstream.read()
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return Response(content, status_code=upstream.status, headers=out)


app = Starlette(
    routes=[Route("/{path:path}", forward, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])],
    lifespan=lifespan,
)
