"""Two small applications guarded in-process by `gateway.RateLimitMiddleware`, for
tests/test_middleware.py to run under uvicorn: a Starlette app and a FastAPI app with the same
endpoints. The middleware's config file and Redis URL come from EMBED_CONFIG and EMBED_REDIS_URL
(unset: the middleware's own default, then the embedded redis-server)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway import RateLimitMiddleware

CONFIG = os.environ.get("EMBED_CONFIG", "routes.yaml")
REDIS_URL = os.environ.get("EMBED_REDIS_URL") or None


async def order(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"item": request.path_params["item"], "length": len(body),
                         "sha256": hashlib.sha256(body).hexdigest()})


async def seen(request: Request) -> JSONResponse:
    return JSONResponse({"path": request.url.path, "headers": [k for k, _ in request.headers.items()]})


async def plain(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request.url.path)


async def completion(request: Request) -> Response:
    """An LLM-style answer: the usage the request asks for, as JSON or as one SSE stream."""
    asked = json.loads(await request.body())
    usage = {"total_tokens": asked["used"]}
    if not asked.get("stream"):
        return JSONResponse({"usage": usage})

    async def events() -> AsyncIterator[bytes]:
        for n in range(3):
            yield b'data: {"choices": [{"delta": {"content": "t%d"}}], "usage": null}\n\n' % n
        yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def chat(websocket: WebSocket) -> None:
    await websocket.accept()
    async for message in websocket.iter_text():
        await websocket.send_text(message)


starlette_app = Starlette(routes=[
    WebSocketRoute("/chat/{room}", chat),
    Route("/v1/completions", completion, methods=["POST"]),
    Route("/orders/{item}", order, methods=["POST"]),
    Route("/seen/{rest:path}", seen),
    Route("/{name}", plain),
])
starlette_app.add_middleware(RateLimitMiddleware, config=CONFIG, redis_url=REDIS_URL)

# the same app mounted under /shop: its routes, and so routes.yaml's paths, are the paths under it
mounted_app = Starlette(routes=[Mount("/shop", app=starlette_app)])



async def starlette_app_without_http_response(scope: Scope, receive: Receive, send: Send) -> None:
    """The Starlette app behind a server that cannot answer a handshake with HTTP (no
    `websocket.http.response` extension): the refusal is a close."""
    if scope["type"] == "websocket":
        scope = {**scope, "extensions": {k: v for k, v in scope.get("extensions", {}).items()
                                         if k != "websocket.http.response"}}
    await starlette_app(scope, receive, send)


fastapi_app = FastAPI()
fastapi_app.add_api_route("/v1/completions", completion, methods=["POST"])


@fastapi_app.post("/orders/{item}")
async def fastapi_order(item: str, request: FastAPIRequest) -> dict[str, object]:
    body = await request.body()
    return {"item": item, "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}


@fastapi_app.get("/seen/{rest:path}")
async def fastapi_seen(rest: str, request: FastAPIRequest) -> dict[str, object]:
    return {"path": request.url.path, "headers": [k for k, _ in request.headers.items()]}


@fastapi_app.get("/{name}")
async def fastapi_plain(name: str) -> PlainTextResponse:
    return PlainTextResponse(f"/{name}")


fastapi_app.add_middleware(RateLimitMiddleware, config=CONFIG, redis_url=REDIS_URL)
