"""The small example backend that the repo's routes.yaml points at (`make run`)."""

from __future__ import annotations

import argparse
import json

from aiohttp import web


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    payload = {
        "backend": "example",
        "method": request.method,
        "path": request.path,
        "query": request.query_string,
        "body_bytes": len(body),
        "x_forwarded_for": request.headers.get("X-Forwarded-For"),
        "x_request_id": request.headers.get("X-Request-Id"),
    }
    if request.path.startswith("/seckill/"):
        payload["order"] = "accepted"
    return web.Response(text=json.dumps(payload) + "\n", content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description="example backend for routes.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", echo)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
