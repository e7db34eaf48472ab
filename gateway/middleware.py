"""The gateway's rules guarding a Starlette or FastAPI application in-process.

    from gateway import RateLimitMiddleware
    app.add_middleware(RateLimitMiddleware, config="routes.yaml", redis_url=None)

A pure ASGI middleware around the same pipeline as the proxy (gateway/pipeline.py): the same request
checks, matching, identities, ONE limiter call per request, refusals, rate-limit headers and failure
policy. Admitted requests go on to the wrapped app as the limiter read them (the normalized path,
trimmed field values, without the fields `Connection` named), with the rate-limit headers added to
its response, and a body read for a `body` identity handed to the app first, whole. A request that
matches no route passes to the app unlimited; other scopes than HTTP and WebSocket pass through
untouched. A WebSocket scope on a route is decided at its handshake, as the GET it came as: an
admitted one goes on to the app (the rate-limit headers added to its `websocket.accept`), a refused
one is answered with the refusal (status, headers and problem+json body) where the server supports
the `websocket.http.response` extension, else accepted and closed at once with code 1008 (policy
violation) and the refusal's detail as the reason. A request the
proxy would refuse before matching (an ambiguous path or framing, an Upgrade, a head too large) is
refused here too only if a route could match the path the app sees: the others are the app's and
its server's business, as they would be without the middleware.

A file that does not validate fails the application's start-up (`lifespan.startup.failed` with
every error, so uvicorn exits), never a request; under a server that runs no lifespan, each request
is answered 500 with the errors.

Redis: `redis_url`, else GATEWAY_REDIS_URL, else the file's `redis.url`, else an embedded
redis-server (in memory, one per process) started with the app's lifespan (or on first use) and
stopped with it (or at exit).

Its life is the gateway's (gateway/lifecycle.py): `reload()` reads the file again as `gateway serve`
does on SIGHUP (a bad file keeps the rules in force), overrides and API keys follow Redis, metrics
are flushed every second, and each request is accounted as the proxy's are (gateway_requests_total,
the access log, /top's records) through the same envelope (gateway/envelope.py).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
from dataclasses import replace
from pathlib import Path
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.accounting import Accounting
from gateway.admitted import Admitted
from gateway.caller_usage import usage_answer
from gateway.config import Config, load_config
from gateway.envelope import Envelope
from gateway.errors import ConfigError
from gateway.http.request import Request
from gateway.lifecycle import Lifecycle
from gateway.outcome import Admit, Answer, RequestBounds, RequestOutcome
from gateway.pipeline import decide
from gateway.request_id import request_id_for
from gateway.responses import Headers, problem, send_answer
from gateway.runtime import Runtime
from gateway.settings import DEFAULTS, from_process_env

log = logging.getLogger("gateway")


class RateLimitMiddleware:
    def __init__(self, app: ASGIApp, config: str | Path = "routes.yaml", redis_url: str | None = None,
                 max_head_bytes: int = DEFAULTS.max_head_bytes) -> None:
        self.app = app
        self.config: Config | None = None
        self.error: ConfigError | None = None
        try:
            self.config = load_config(config, proxy=False)
        except ConfigError as exc:  # Starlette builds middleware lazily: reported at start-up, not raised here
            self.error = exc
        settings = from_process_env()
        # an embedded Redis of its own per process, in memory: an application's workers are processes
        # the middleware does not supervise, and two servers may not share one data directory
        self.settings = replace(settings, config_path=str(config), redis_url=redis_url or settings.redis_url,
                                ephemeral=True)
        self.limits = RequestBounds(max_head_bytes=max_head_bytes, body_timeout=self.settings.body_timeout)
        self.lifecycle = Lifecycle(self.settings, self.config, proxy=False, worker=False)
        self.accounting = Accounting(self.lifecycle.top)
        self._starting = asyncio.Lock()

    @property
    def runtime(self) -> Runtime | None:
        return self.lifecycle.runtime

    def reload(self) -> tuple[bool, str]:
        """Read the file again and apply it (validated first: on any error the rules in force stay),
        as `gateway serve` does on SIGHUP; the requests in flight finish on the rules they began with."""
        if self.error is not None:
            return False, "the middleware never started: its file did not load"
        return self.lifecycle.reload()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.error is not None:
            await send_answer(send, problem(500, f"the rate limits could not be loaded:\n{self.error}"))
            return
        runtime = self.runtime or await self._start()
        routed, mount = _within_mount(scope)
        with Envelope(runtime, self.accounting, scope) as envelope:
            result = envelope.result = await decide(runtime, routed, receive, self.limits)
            if isinstance(result, Answer):
                if _passes_to_app(result, runtime, routed):
                    await self.app(scope, receive, _status_to(envelope, send))
                elif result.outcome is not RequestOutcome.CLIENT_GONE:
                    envelope.request_id = result.request_id or b""
                    envelope.status = await send_answer(send, (result.status, result.headers, result.body))
                return
            envelope.request_id = request_id_for(result.request.request_id)
            async with Admitted(runtime, result) as after:  # slots held while the app answers, the delay waited
                if result.plan.route.respond is not None:  # respond: usage, answered here, not by the app
                    status, headers, body = await usage_answer(runtime, result)
                    envelope.status = after.status = await send_answer(send, (status, [*result.headers, *headers],
                                                                              body))
                    return
                if result.body_prefix is not None and result.request.has_body:
                    receive = _replay(result.body_prefix, result.more_body, receive)
                if result.headers:
                    send = _with_headers(send, result.headers)
                await self._call_app(after, result, _as_decided(scope, routed, mount, result.request), receive,
                                     _status_to(envelope, send))

    async def _call_app(self, after: Admitted, result: Admit, scope: Scope, receive: Receive, send: Send) -> None:
        if not after.settles:
            await self.app(scope, receive, send)
            return
        try:  # the app answered nothing: 499 (`after`'s default), the client left
            await self.app(scope, receive, _settling(send, after, result.plan.withheld))
        except BaseException:
            after.status = 500
            raise

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One WebSocket scope, decided at its handshake (before the app can accept it)."""
        if self.error is not None:
            await _refuse_websocket(scope, receive, send, problem(500, "the rate limits could not be loaded"), 1011)
            return
        runtime = self.runtime or await self._start()
        routed, mount = _within_mount(scope)
        handshake = _handshake(routed)
        with Envelope(runtime, self.accounting, handshake) as envelope:
            result = envelope.result = await decide(runtime, handshake, _no_body, self.limits)
            if isinstance(result, Answer):
                if _passes_to_app(result, runtime, routed):
                    await self.app(scope, receive, send)
                    envelope.status = 101
                elif result.outcome is not RequestOutcome.CLIENT_GONE:
                    envelope.status = result.status
                    await _refuse_websocket(scope, receive, send, (result.status, result.headers, result.body), 1008)
                return
            envelope.request_id = request_id_for(result.request.request_id)
            async with Admitted(runtime, result) as after:  # slots held while the socket is open
                await self._websocket_app(after, result, _as_decided(scope, routed, mount, result.request),
                                          receive, send)
                envelope.status = after.status if after.settles else 101

    async def _websocket_app(self, after: Admitted, result: Admit, scope: Scope, receive: Receive,
                             send: Send) -> None:
        if result.headers:
            send = _with_headers(send, result.headers, "websocket.accept")
        if not after.settles:
            await self.app(scope, receive, send)
            return
        accepted = False

        async def sending(message: Message) -> None:
            nonlocal accepted
            accepted = accepted or message["type"] == "websocket.accept"
            await send(message)

        try:  # counted by the answer: a 101 when the app accepted, else the 403 servers answer for it
            await self.app(scope, receive, sending)
        finally:
            after.status = 101 if accepted else 403

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def starting(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.close()
            await send(message)

        if self.error is None:
            await self.app(scope, self._start_first(receive), starting)
            return
        message = await receive()  # lifespan.startup: refused with every error, so the server exits
        assert message["type"] == "lifespan.startup"
        text = f"the rate limits could not be loaded:\n{self.error}"
        log.error("%s", text)
        await send({"type": "lifespan.startup.failed", "message": text})

    def _start_first(self, receive: Receive) -> Receive:
        """The lifespan's messages, the runtime started (Redis connected or embedded) at start-up."""
        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._start()
            return message

        return receiving

    async def _start(self) -> Runtime:
        async with self._starting:
            if self.lifecycle.runtime is None:
                await self.lifecycle.startup()
                if self.lifecycle.embedded is not None:  # a server that runs no lifespan: stopped at exit
                    atexit.register(self.lifecycle.embedded.stop)
            runtime = self.lifecycle.runtime
            assert runtime is not None
            return runtime

    async def close(self) -> None:
        """As the application's lifespan ends: the last charges, refunds and slots reach Redis, then
        the connections close (and the embedded Redis stops)."""
        if self.lifecycle.runtime is not None:
            await self.lifecycle.shutdown()


def _status_to(envelope: Envelope, send: Send) -> Send:
    """`send`, the status of the app's answer noted for the request's accounting."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            envelope.status = message["status"]
        await send(message)

    return sending


def _passes_to_app(answer: Answer, runtime: Runtime, scope: Scope) -> bool:
    """No route of this file is about the request: it is the app's (and its server's) business."""
    if answer.route:
        return False
    if answer.outcome is RequestOutcome.BAD_REQUEST:  # refused before matching
        return not runtime.router.may_match(scope["path"])
    return answer.outcome in (RequestOutcome.NO_ROUTE, RequestOutcome.METHOD_NOT_ALLOWED)


def _within_mount(scope: Scope) -> tuple[Scope, bytes]:
    """The request as the app's routes see it, and the raw prefix taken off: mounted under a path
    (Starlette's Mount, a server's --root-path), an app routes on the path less `root_path`, as
    Starlette's get_route_path does, so that is what routes.yaml's paths name. A raw path whose
    first segments do not spell `root_path` is left whole."""
    root: str = scope.get("root_path") or ""
    path: str = scope["path"]
    if not root or root == "/" or not (path == root or path.startswith(root + "/")):
        return scope, b""
    raw: bytes = scope.get("raw_path") or path.encode("utf-8")
    segments = root.count("/")
    prefix = b"/".join(raw.split(b"/", segments + 1)[:segments + 1])
    if unquote(prefix.decode("latin-1"), errors="surrogateescape") != root:
        return scope, b""
    return {**scope, "path": path[len(root):] or "/", "raw_path": raw[len(prefix):] or b"/"}, prefix


def _as_decided(scope: Scope, routed: Scope, mount: bytes, request: Request) -> Scope:
    """The request as the limiter read it, for the app: the normalized path that was matched (under
    the mount's, `routed` being the scope the limiter read), field values without surrounding
    whitespace, without the fields `Connection` named, and the framing of a body the gateway
    rewrote."""
    if request.path == routed["path"] and not request.dropped and not request.trimmed and not request.body_rewritten:
        return scope
    headers = scope["headers"]
    if request.dropped:
        headers = [(name, value) for name, value in headers if name not in request.dropped]
    if request.trimmed:
        headers = [(name, value.strip(b" \t")) for name, value in headers]
    if request.body_rewritten:
        headers = [*((name, value) for name, value in headers if name not in (b"content-length", b"transfer-encoding")),
                   (b"content-length", b"%d" % (request.content_length or 0))]
    root: str = (scope.get("root_path") or "") if mount else ""
    return {**scope, "path": root + request.path, "raw_path": mount + request.raw_path, "headers": headers}


def _replay(prefix: bytes, more: bool, receive: Receive) -> Receive:
    """The body the pipeline read first (for a `body` identity), then the rest from the client."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": prefix, "more_body": more}
        return await receive()

    return replayed


def _handshake(scope: Scope) -> Scope:
    """A WebSocket scope as the GET that opened it, for the pipeline: its Upgrade is the server's
    business, already done, so the route need not say `websocket: true` (that is the proxy's)."""
    headers = []
    for name, value in scope["headers"]:
        if name == b"upgrade":
            continue
        if name == b"connection":
            tokens = [t for t in value.split(b",") if t.strip().lower() != b"upgrade"]
            if not tokens:
                continue
            value = b",".join(tokens)
        headers.append((name, value))
    scheme = "https" if scope.get("scheme") == "wss" else "http"
    return {**scope, "type": "http", "method": "GET", "scheme": scheme, "headers": headers}


async def _no_body() -> Message:
    return {"type": "http.disconnect"}  # a handshake has no body (never asked: it has no framing)


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send, answer: tuple[int, Headers, bytes],
                            code: int) -> None:
    """The refusal as an HTTP answer to the handshake where the server can send one, else a close."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    status, headers, body = answer
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
        return
    try:
        reason = str(json.loads(body)["detail"])
    except (ValueError, KeyError, TypeError):
        reason = ""
    while len(reason.encode()) > 123:  # a close frame's reason is at most 123 bytes (RFC 6455 5.5)
        reason = reason[:-1]
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": code, "reason": reason})


def _settling(send: Send, after: Admitted, withheld: frozenset[bytes]) -> Send:
    """Charges and refunds as the app's answer starts (counting by the answer), the fields that
    declare a cost withheld from the client."""
    usage = after.usage

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            fields = [(name.lower(), value) for name, value in message.get("headers", ())]
            declared: dict[str, str] = {}
            for name, value in fields:
                if name in withheld:  # a field sent twice: both values, as httpx.Headers joins them for the proxy
                    key, text = name.decode("latin-1"), value.decode("latin-1")
                    declared[key] = f"{declared[key]}, {text}" if key in declared else text
            content_type = next((value.decode("latin-1") for name, value in fields if name == b"content-type"), "")
            after.answered(message["status"], declared, content_type)
            if declared:
                kept = [field for field in message.get("headers", ()) if field[0].lower() not in withheld]
                message = {**message, "headers": kept}
        await send(message)
        if usage is not None and message["type"] == "http.response.body":  # a token budget reads the body
            usage.feed(message.get("body", b""))
            if not message.get("more_body", False):
                usage.end(True)

    return sending


def _with_headers(send: Send, headers: list[tuple[bytes, bytes]], start: str = "http.response.start") -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == start:
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending
