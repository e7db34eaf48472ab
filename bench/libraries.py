#!/usr/bin/env python3
"""The price of each library on the forwarding path, measured piece by piece in one process:
client CPU (process time) per request, 50 requests in flight where there is I/O.

    .venv/bin/python bench/libraries.py [--requests 20000]

1. the application frame: a pure ASGI endpoint called directly, then through the gateway's
   Starlette application (AdminPort and Proxied routes, Starlette's middleware stack), and with
   a `Mount("")` in place of the Proxied route, as the gateway had it before;
2. httpx's models: one httpx.Request (the gateway's forwarded head) and one httpx.Response;
3. the upstream transport, against a local nginx answering `return 200 "ok"`: LeanTransport vs
   httpx's AsyncHTTPTransport (HTTP/1.1), both through httpx.Request/Response, and
   httpx.AsyncClient.send for reference.

Redis client prices (redis-py batched vs unbatched) are bench/redis_client.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import uvloop
from starlette.applications import Starlette
from starlette.routing import Match, Mount

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import Processes, free_port, start_nginx, upstream_server

from gateway.app import AdminPort, Proxied
from gateway.config import Upstream
from gateway.http.transport import LeanTransport

HEADERS = [
    (b"host", b"127.0.0.1:9000"), (b"user-agent", b"wrk"), (b"accept", b"*/*"), (b"x-user-id", b"bench-user"),
    (b"x-forwarded-for", b"127.0.0.1"), (b"x-forwarded-proto", b"http"), (b"x-forwarded-host", b"gw"),
    (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
]


def cpu_per_call(calls: int, run: Callable[[], Coroutine[Any, Any, None]]) -> float:
    """µs of this process's CPU per call of `run` (which makes `calls` calls)."""
    started = time.process_time()
    uvloop.run(run())
    return (time.process_time() - started) / calls * 1e6


async def _endpoint(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


def frame(n: int) -> dict[str, float]:
    scope_base = {"type": "http", "method": "GET", "path": "/api/items/42", "raw_path": b"/api/items/42",
                  "root_path": "", "query_string": b"", "headers": HEADERS, "server": ("127.0.0.1", 8080),
                  "client": ("127.0.0.1", 5000), "scheme": "http", "http_version": "1.1",
                  "asgi": {"version": "3.0"}}
    app = Starlette(routes=[AdminPort(9090, _endpoint), Proxied(_endpoint)])
    mounted = Starlette(routes=[AdminPort(9090, _endpoint), Mount("", app=_endpoint)])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    def loop(target: Any) -> Callable[[], Coroutine[Any, Any, None]]:
        async def go() -> None:
            for _ in range(n):
                await target(dict(scope_base), receive, send)
        return go

    plain = cpu_per_call(n, loop(_endpoint))
    starlette = cpu_per_call(n, loop(app))
    mount = cpu_per_call(n, loop(mounted))
    return {"pure ASGI endpoint": plain, "Starlette app (AdminPort + Proxied)": starlette,
            "Starlette frame, added": starlette - plain, "Starlette app (AdminPort + Mount)": mount}


def matching(n: int) -> dict[str, float]:
    """The repository's routes.yaml (seckill, then a catch-all): our router vs Starlette's routes."""
    from starlette.routing import Route as StarletteRoute

    from gateway.config import load_config
    from gateway.match import Router

    config = load_config(Path(__file__).resolve().parent.parent / "routes.yaml")
    ours = Router(config.routes)
    theirs = [StarletteRoute(r.path, _endpoint, methods=sorted(r.methods) if r.methods else None)
              for r in config.routes]
    scope = {"type": "http", "method": "GET", "path": "/api/items/42", "root_path": ""}

    async def with_ours() -> None:
        for _ in range(n):
            ours.match("GET", "", "/api/items/42")

    async def with_starlette() -> None:
        for _ in range(n):
            for route in theirs:
                if route.matches(scope)[0] is Match.FULL:
                    break

    return {"route match: gateway.match.Router": cpu_per_call(n, with_ours),
            "route match: Starlette Route.matches": cpu_per_call(n, with_starlette)}


def models(n: int) -> dict[str, float]:
    url = httpx.URL("http://127.0.0.1:9000/")

    async def requests() -> None:
        for _ in range(n):
            httpx.Request("GET", url, headers=HEADERS, extensions={"target": b"/api/items/42"})

    async def responses() -> None:
        raw = [(b"content-type", b"text/plain"), (b"content-length", b"2"), (b"server", b"nginx")]
        for _ in range(n):
            httpx.Response(200, headers=raw, extensions={"http_version": b"HTTP/1.1"})

    return {"httpx.Request": cpu_per_call(n, requests), "httpx.Response": cpu_per_call(n, responses)}


def transports(n: int, port: int) -> dict[str, float]:
    upstream = Upstream("u", f"http://127.0.0.1:{port}", max_connections=64)
    url = httpx.URL(f"http://127.0.0.1:{port}/")

    def through(make: Callable[[], httpx.AsyncBaseTransport]) -> Callable[[], Coroutine[Any, Any, None]]:
        async def go() -> None:
            transport = make()

            async def worker(count: int) -> None:
                for _ in range(count):
                    request = httpx.Request("GET", url, headers=HEADERS, extensions={"target": b"/x"})
                    response = await transport.handle_async_request(request)
                    assert isinstance(response.stream, httpx.AsyncByteStream)
                    async for _chunk in response.stream:
                        pass
                    await response.aclose()

            await asyncio.gather(*(worker(n // 50) for _ in range(50)))
            await transport.aclose()
        return go

    async def client_send() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            async def worker(count: int) -> None:
                for _ in range(count):
                    response = await client.send(httpx.Request("GET", f"http://127.0.0.1:{port}/x", headers=HEADERS))
                    await response.aread()

            await asyncio.gather(*(worker(n // 50) for _ in range(50)))

    return {
        "LeanTransport (httpx.Request -> Response, body read)": cpu_per_call(
            n, through(lambda: LeanTransport(upstream))),
        "httpx.AsyncHTTPTransport, HTTP/1.1 (the same)": cpu_per_call(
            n, through(lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=64)))),
        "httpx.AsyncClient.send (reference)": cpu_per_call(n // 4, client_send),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    n = args.requests
    rows: dict[str, float] = {}
    rows.update(frame(n * 5))
    rows.update(matching(n * 5))
    rows.update(models(n * 5))
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes(Path(tmp))
        port = free_port()
        try:
            start_nginx(procs, "upstream", Path(tmp) / "upstream", port, 1, upstream_server(port))
            rows.update(transports(n, port))
        finally:
            procs.stop_all()
    print(f"client CPU per request, µs ({n:,} requests through each transport, 50 in flight)")
    for name, value in rows.items():
        print(f"  {value:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
