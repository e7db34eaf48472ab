"""The gateway's rules guarding a Starlette or FastAPI application in-process.

    from gateway import RateLimitMiddleware
    app.add_middleware(RateLimitMiddleware, config="routes.yaml", redis_url=None)

A pure ASGI middleware: the same request checks, matching, identities, ONE limiter call per
request, refusals, rate-limit headers and failure policy as the proxy (gateway/guard.py decides for
both); admitted requests go on to the wrapped app with the rate-limit headers added to its
response, and a body read for a `body` identity is handed to the app first, whole. A request that
matches no route passes to the app unlimited; non-HTTP scopes pass through untouched. A request
the proxy would refuse before matching (an ambiguous path or framing, an Upgrade, a head too large)
is refused here too only if a route could match the path the app sees: the others are the app's
and its server's business, as they would be without the middleware.

Redis: `redis_url`, else GATEWAY_REDIS_URL, else the file's `redis.url`, else an embedded
redis-server started on first use and stopped with the app's lifespan (or at exit).
"""

from __future__ import annotations

import asyncio
import atexit
import os
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import Config, load_config
from gateway.embedded import EmbeddedRedis
from gateway.errors import BadRequest
from gateway.guard import judge
from gateway.http.request import DEFAULT_MAX_HEAD_BYTES, Request, read_request
from gateway.identity import RequestView
from gateway.responses import problem, send_answer
from gateway.runtime import Runtime, build_runtime, new_limiter
from gateway.settings import Settings, redis_settings


class RateLimitMiddleware:
    def __init__(self, app: ASGIApp, config: str | Path = "routes.yaml", redis_url: str | None = None,
                 max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES) -> None:
        self.app = app
        self.config: Config = load_config(config, proxy=False)  # a bad file fails here, with file:line: key
        url = redis_url or os.environ.get("GATEWAY_REDIS_URL") or None
        self.settings = Settings(config_path=str(config), redis_url=url)
        self.max_head_bytes = max_head_bytes
        self.runtime: Runtime | None = None
        self.embedded: EmbeddedRedis | None = None
        self._starting = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        runtime = self.runtime or await self._start()
        try:
            request = read_request(scope, self.max_head_bytes)
        except BadRequest as exc:
            if not runtime.router.may_match(scope["path"]):
                await self.app(scope, receive, send)
                return
            await send_answer(send, problem(exc.status, str(exc)))
            return
        found = runtime.router.match(request.method, request.hostname, request.path)
        if found is None:
            await self.app(scope, receive, send)
            return
        route, params = found
        verdict = await judge(runtime, runtime.plans[route.name], RequestView(request, params, runtime.config,
                                                                               runtime.jwt), receive)
        if verdict.answer is not None:
            await send_answer(send, verdict.answer)
            return
        if verdict.outcome == "client_gone":
            return
        if verdict.delay_ms > 0:
            await asyncio.sleep(verdict.delay_ms / 1000)
        if verdict.body_prefix is not None and request.has_body:
            receive = _replay(verdict.body_prefix, verdict.more_body, receive)
        if verdict.headers:
            send = _with_headers(send, verdict.headers)
        await self.app(_as_decided(scope, request), receive, send)

    async def _start(self) -> Runtime:
        async with self._starting:
            if self.runtime is None:
                settings = self.settings
                if not (settings.redis_url or self.config.redis.url):
                    self.embedded = EmbeddedRedis()
                    await asyncio.get_running_loop().run_in_executor(None, self.embedded.start)
                    atexit.register(self.embedded.stop)
                    settings = Settings(config_path=settings.config_path, embedded_redis_url=self.embedded.url)
                redis = redis_settings(settings, self.config)
                self.runtime = build_runtime(self.config, redis, new_limiter(redis))
            return self.runtime

    async def close(self) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            await runtime.limiter.close()
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.close()
            await send(message)

        return lifespan_send


def _as_decided(scope: Scope, request: Request) -> Scope:
    """The request as the limiter saw it, for the app: the normalized path that was matched, and
    without the fields `Connection` named (which no identity could read)."""
    if request.path == scope["path"] and not request.dropped:
        return scope
    headers = scope["headers"]
    if request.dropped:
        headers = [(name, value) for name, value in headers if name not in request.dropped]
    return {**scope, "path": request.path, "raw_path": request.raw_path, "headers": headers}


def _replay(prefix: bytes, more: bool, receive: Receive) -> Receive:
    """The body the guard read first (for a `body` identity), then the rest from the client."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": prefix, "more_body": more}
        return await receive()

    return replayed


def _with_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending
