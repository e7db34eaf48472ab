"""The small example backend that the repo's routes.yaml points at (`make run`): a Starlette app
under uvicorn that echoes what it received. Orders are taken by `POST /seckill/{item_id}` (with or
without a trailing slash, as the gateway's route matches it) and nowhere else; `POST /login` lets
in the password `demo` and answers 401 to any other."""

from __future__ import annotations

import argparse
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
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


async def login(request: Request) -> Response:
    ok = (await request.body()).strip() == b"password=demo"
    return Response(json.dumps({"login": ok}) + "\n", status_code=200 if ok else 401, media_type="application/json")


app = Starlette(routes=[
    Route("/login", login, methods=["POST"]),
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
