"""A real upstream HTTP server for the end-to-end tests (run as a subprocess).

    GET/POST /echo            JSON: method, path, query, headers, body length and sha256
    GET      /bytes?size=N    streams N bytes (1 MiB chunks) without holding them
    GET      /drip?chunk=N&every=S&count=C  streams N bytes every S seconds (chunked), C times (default:
                              until the gateway lets go)
    POST     /upload          consumes the body chunk by chunk; JSON: length and sha256
    GET      /slow?delay=S    answers after S seconds
    GET      /status/N        answers with status N
    POST     /signin          200 with X-Password: right, else 401 (after ?delay=S seconds)
    POST     /flaky/...       every third request fails with 503; GET /flaky-ok counts the others
    GET      /tokens?n=N      200, declaring its cost in X-Tokens: N
    GET      /inflight?delay=S  answers after S seconds; GET /inflight-max: the most ever in flight at once
    GET      /arrived?path=P  how many requests for path P have reached this server (a test's event)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import subprocess
import sys
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from tests.support.orphans import started
from tests.support.ports import free_port

CHUNK = b"x" * (1 << 20)


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    payload = {
        "method": request.method,
        "path": request.path,
        "raw_path": request.raw_path,
        "query": request.query_string,
        "headers": [[k, v] for k, v in request.headers.items()],
        "length": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "received_at": time.time(),
    }
    return web.json_response(payload, headers={"X-Upstream": "echo", "Keep-Alive": "timeout=5"})


async def stream_bytes(request: web.Request) -> web.StreamResponse:
    size = int(request.query.get("size", "0"))
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = size
    await response.prepare(request)
    left = 0 if request.method == "HEAD" else size
    while left > 0:
        piece = CHUNK if left >= len(CHUNK) else CHUNK[:left]
        await response.write(piece)
        left -= len(piece)
    await response.write_eof()
    return response


async def drip(request: web.Request) -> web.StreamResponse:
    chunk = b"d" * int(request.query.get("chunk", "1024"))
    every = float(request.query.get("every", "0.1"))
    count = int(request.query.get("count", "-1"))  # -1: until the connection closes (the write fails)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while count != 0:
        await response.write(chunk)
        count -= 1
        if count:
            await asyncio.sleep(every)
    await response.write_eof()
    return response


async def upload(request: web.Request) -> web.Response:
    digest = hashlib.sha256()
    length = 0
    async for chunk in request.content.iter_any():
        digest.update(chunk)
        length += len(chunk)
    return web.json_response({"length": length, "sha256": digest.hexdigest()})


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("delay", "1")))
    return web.json_response({"slow": True})


async def status(request: web.Request) -> web.Response:
    return web.json_response({"status": True}, status=int(request.match_info["code"]))


async def login(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("delay", "0")))
    ok = request.headers.get("X-Password") == "right"
    return web.json_response({"login": ok}, status=200 if ok else 401)


FLAKY: dict[str, int] = {"seen": 0, "ok": 0}


async def flaky(request: web.Request) -> web.Response:
    FLAKY["seen"] += 1
    if FLAKY["seen"] % 3 == 0:
        return web.json_response({"ordered": False}, status=503)
    FLAKY["ok"] += 1
    return web.json_response({"ordered": True})


async def flaky_ok(request: web.Request) -> web.Response:
    return web.json_response(FLAKY)


async def tokens(request: web.Request) -> web.Response:
    return web.json_response({"tokens": True}, headers={"X-Tokens": request.query.get("n", "1")})


IN_FLIGHT = {"now": 0, "most": 0}


async def inflight(request: web.Request) -> web.Response:
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["most"] = max(IN_FLIGHT["most"], IN_FLIGHT["now"])
    try:
        await asyncio.sleep(float(request.query.get("delay", "0.2")))
    finally:
        IN_FLIGHT["now"] -= 1
    return web.json_response({"inflight": True})


async def inflight_most(request: web.Request) -> web.Response:
    return web.json_response(IN_FLIGHT)


ARRIVED: dict[str, int] = {}


@web.middleware
async def count_arrivals(request: web.Request, handler: Handler) -> web.StreamResponse:
    ARRIVED[request.path] = ARRIVED.get(request.path, 0) + 1
    return await handler(request)


async def arrived(request: web.Request) -> web.Response:
    return web.Response(text=str(ARRIVED.get(request.query["path"], 0)))


def make_app() -> web.Application:
    app = web.Application(client_max_size=1 << 40, middlewares=[count_arrivals])
    app.router.add_get("/arrived", arrived)
    app.router.add_route("*", "/echo", echo)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_get("/bytes", stream_bytes)
    app.router.add_get("/drip", drip)
    app.router.add_post("/upload", upload)
    app.router.add_get("/slow", slow)
    app.router.add_get("/status/{code}", status)
    app.router.add_post("/signin", login)
    app.router.add_post("/flaky/{tail:.*}", flaky)
    app.router.add_get("/flaky-ok", flaky_ok)
    app.router.add_get("/tokens", tokens)
    app.router.add_get("/inflight", inflight)
    app.router.add_get("/inflight-max", inflight_most)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


class Upstream:
    """Runs this module (or a subclass's `module`) in a subprocess on a free port."""

    module = "tests.support.upstream"

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arrived(self, path: str) -> int:
        """How many requests for `path` have reached this upstream so far."""
        import httpx

        return int(httpx.get(f"{self.url}/arrived", params={"path": path}, timeout=5).text)

    def start(self) -> None:
        self.process = started(
            [sys.executable, "-m", self.module, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        from tests.support.waiting import wait_for_port

        wait_for_port(self.port, self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:  # a handler still sleeping for a client that died
                self.process.kill()
                self.process.wait()
            self.process = None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # stopped at once on SIGTERM: a handler still sleeping for a client that left answers nobody
    web.run_app(make_app(), host="127.0.0.1", port=args.port, print=None, access_log=None, shutdown_timeout=0.1)


if __name__ == "__main__":
    main()
