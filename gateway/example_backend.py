"""The small example backend that the repo's routes.yaml points at (`make run`): a Starlette app
under uvicorn that echoes what it received. Orders are taken by `POST /seckill/{item_id}` (with or
without a trailing slash, as the gateway's route matches it) and nowhere else; `POST /login` lets
in the password `demo` and answers 401 to any other; `POST /v1/chat/completions` answers as an
OpenAI-compatible API does (JSON, or Server-Sent Events when asked to stream), with its usage."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


async def echo(request: Request) -> Response:
    return await answer(request, order=False)


async def order(request: Request) -> Response:
    return await answer(request, order=True)


async def answer(request: Request, order: bool) -> Response:
    body = await request.body()
    payload = {
        "backend": "example",
        "method": request.method,
        "path": request.url.path,
        "query": request.url.query,
        "body_bytes": len(body),
        "x_forwarded_for": request.headers.get("X-Forwarded-For"),
        "x_request_id": request.headers.get("X-Request-Id"),
    }
    if order:
        payload["order"] = "accepted"
    return Response(json.dumps(payload) + "\n", media_type="application/json")


async def chat(request: Request) -> Response:
    """An OpenAI-compatible chat completion: JSON, or Server-Sent Events for `"stream": true`, the
    usage in the answer (the last chunk when streaming, as with stream_options.include_usage)."""
    try:
        asked = json.loads(await request.body() or b"{}")
    except ValueError:
        asked = {}
    if not isinstance(asked, dict):
        asked = {}
    limit = asked.get("max_tokens")
    words = ["Tokens", " are", " counted", " after", " the", " answer", "."]
    if isinstance(limit, int) and limit > 0:
        words = words[:limit]
    usage = {"prompt_tokens": 12, "completion_tokens": len(words), "total_tokens": 12 + len(words)}
    if not asked.get("stream"):
        answer = {"id": "chatcmpl-example", "object": "chat.completion", "model": "example",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                               "finish_reason": "stop"}], "usage": usage}
        return Response(json.dumps(answer) + "\n", media_type="application/json")

    async def events() -> AsyncIterator[bytes]:
        for word in words:
            chunk = {"id": "chatcmpl-example", "object": "chat.completion.chunk", "model": "example",
                     "choices": [{"index": 0, "delta": {"content": word}}], "usage": None}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.sleep(0.05)
        final = {"id": "chatcmpl-example", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        yield b"data: " + json.dumps(final).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def login(request: Request) -> Response:
    ok = (await request.body()).strip() == b"password=demo"
    return Response(json.dumps({"login": ok}) + "\n", status_code=200 if ok else 401, media_type="application/json")


app = Starlette(routes=[
    Route("/login", login, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/seckill/{item_id}", order, methods=["POST"]),
    Route("/seckill/{item_id}/", order, methods=["POST"]),
    Route("/{tail:path}", echo, methods=METHODS),
])


def main() -> None:
    parser = argparse.ArgumentParser(description="example backend for routes.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
