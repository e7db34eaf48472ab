"""Origin servers on different HTTP parsers and frameworks, for the differential test: each
answers with what its application reads of a request, through the framework's own accessors.

    python -m tests.conformance.origins h11 PORT        # uvicorn + h11, Starlette
    python -m tests.conformance.origins httptools PORT  # uvicorn + httptools (llhttp), Starlette
    python -m tests.conformance.origins aiohttp PORT    # aiohttp's own server and parser
"""

from __future__ import annotations

import json
import sys
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def _number(path: str) -> str | None:
    """The number a typed path parameter reads as, the laxest way (Python's int(), as FastAPI's
    `item_id: int` and Django's int converter take it after the framework decoded the path)."""
    segment = path.rstrip("/").rsplit("/", 1)[-1]
    try:
        return str(int(segment))
    except ValueError:
        return None


OVERRIDES = ("x-http-method-override", "x-http-method", "x-method-override")
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]


def _int(value: str | None) -> str | None:
    """A typed source as the laxest reader takes it (Python's int(), as pydantic does after the
    framework decoded the value)."""
    if value is None:
        return None
    try:
        return str(int(value))
    except ValueError:
        return None


def _read(user: str | None, query_id: str | None, sid: str | None, host: str | None, body: bytes,
          path: str, method: str, header: Any, query: Any, cookies: Any) -> dict[str, Any]:
    acted = "GET" if method == "HEAD" else method  # the GET handler serves HEAD
    named = next((header(name) for name in OVERRIDES if header(name) is not None), None)
    overridden = named.strip().upper() if named is not None else acted  # Express's method-override, Symfony
    return {"user": user, "id": query_id, "sid": sid, "host": host, "body": body.hex(),
            "item": _number(path) if path.startswith("/n-") else None,
            "method": acted, "overridden": "GET" if overridden == "HEAD" else overridden,
            "q_item": _int(query("item")), "h_item": _int(header("x-item")), "c_item": _int(cookies("item"))}


def _answer(read: dict[str, Any]) -> dict[str, str]:
    return {"x-read": json.dumps(read)}  # a HEAD answer has no body: what was read goes in a field too


async def starlette_echo(request: Request) -> JSONResponse:
    body = await request.body()
    read = _read(request.headers.get("x-user-id"), request.query_params.get("id"), request.cookies.get("sid"),
                 request.headers.get("x-forwarded-host"), body, request.scope["path"], request.method,
                 request.headers.get, request.query_params.get, request.cookies.get)
    return JSONResponse(read, headers=_answer(read))


starlette_app = Starlette(routes=[Route("/{rest:path}", starlette_echo, methods=METHODS)])


def run_aiohttp(port: int) -> None:
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        read = _read(request.headers.get("X-User-Id"), request.query.get("id"), request.cookies.get("sid"),
                     request.headers.get("X-Forwarded-Host"), body, request.path, request.method,
                     request.headers.get, request.query.get, request.cookies.get)
        return web.json_response(read, headers=_answer(read))

    app = web.Application()
    app.router.add_route("*", "/{rest:.*}", echo)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main(kind: str, port: int) -> None:
    if kind == "aiohttp":
        run_aiohttp(port)
        return
    import uvicorn

    uvicorn.run(starlette_app, host="127.0.0.1", port=port, http=kind, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
