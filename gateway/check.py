"""The check endpoint: the forward-auth question of nginx `auth_request`,
ingress-nginx `auth-url`, Traefik `ForwardAuth`, Caddy `forward_auth` and Envoy `ext_authz` (HTTP).

Every request on the check port asks "may this request pass?" about another request, the one the
proxy in front holds. `Asked` reads that request from the proxy's convention, and the
pipeline (gateway/pipeline.py) decides it exactly as on the proxy port: same routes, identities,
canonical request, one script call, refusals held in memory, overrides, metrics. Nothing is ever
forwarded, so no rule that needs the upstream's answer can be decided here: the loader refuses
them while the check port is on (`Rule.unseen_by_a_check`).

    Admitted (or failed open)   200, empty body, the rate-limit headers for the proxy to copy
    Refused                     section 4's answer (429 + Retry-After + problem+json, 503, 400)
    No route                    200: the check is about limits, not about routing
    check.deny_status: 403      every refusal becomes a 403 carrying X-RateLimit-Status: 429 (or 503,
                                400) and Retry-After, for nginx, whose auth_request turns any other
                                status into a 500 (docs/behind-a-proxy.md hands the client its 429)
"""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping
from typing import Any
from urllib.parse import unquote, urlsplit

from starlette.types import Receive, Scope, Send

from gateway.accounting import Accounting
from gateway.admitted import Admitted
from gateway.config import Config
from gateway.envelope import Envelope
from gateway.errors import BadRequest
from gateway.outcome import Admit, Answer, RequestBounds, RequestOutcome
from gateway.pipeline import decide
from gateway.responses import Headers, send_answer
from gateway.runtime import Runtime

# The conventions, in the order they are believed: Traefik and Caddy, then nginx and ingress-nginx;
# without either, the request line itself (Envoy). Their fields never reach the pipeline.
FORWARDED_METHOD, FORWARDED_URI = b"x-forwarded-method", b"x-forwarded-uri"
FORWARDED_HOST, FORWARDED_PROTO = b"x-forwarded-host", b"x-forwarded-proto"
ORIGINAL_METHOD, ORIGINAL_URI, ORIGINAL_URL = b"x-original-method", b"x-original-uri", b"x-original-url"
_NAMES = {name: name.decode().title().replace("Uri", "URI").replace("Url", "URL")
          for name in (FORWARDED_METHOD, FORWARDED_URI, FORWARDED_HOST, FORWARDED_PROTO,
                       ORIGINAL_METHOD, ORIGINAL_URI, ORIGINAL_URL)}  # as the docs spell them
CONVENTION = frozenset(_NAMES)
_METHOD = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")  # RFC 9110 5.6.2 token
_ANSWERED = (b"content-length", b"0")
_NOTHING_TO_CHECK: tuple[int, Headers, bytes] = (200, [_ANSWERED], b"")


class CheckEndpoint:
    """The check port's door (gateway/http/early.py `Door`): the server protocol calls it with the
    request and writes the whole answer it returns. `asgi` is the same endpoint as an ASGI app, for
    a server without doors (uvicorn's own protocol, in the comparison the tests run)."""

    def __init__(self, current: Callable[[], Runtime | None], limits: RequestBounds, accounting: Accounting) -> None:
        self.current = current
        self.limits = limits
        self.accounting = accounting

    async def __call__(self, scope: Scope, receive: Receive) -> tuple[int, Headers, bytes] | None:
        runtime = self.current()
        assert runtime is not None, "the lifespan starts the runtime before any request"
        config = runtime.config
        asked = Asked(config.check_path_prefix, config.check_convention)
        with Envelope(runtime, self.accounting, scope) as envelope:
            result = envelope.result = await decide(runtime, scope, receive, self.limits, original=asked)
            if config.access_log:
                envelope.scope = asked.logged(scope)
            if isinstance(result, Admit):
                if result.delay_ms or result.lease is not None or result.settlement is not None:
                    async with Admitted(runtime, result) as after:  # a leaky bucket's wait: the proxy waits on it
                        after.status = 200
                answer = 200, [*result.headers, _ANSWERED], b""
            elif result.outcome in (RequestOutcome.NO_ROUTE, RequestOutcome.METHOD_NOT_ALLOWED):
                answer = _NOTHING_TO_CHECK
            elif result.outcome is RequestOutcome.CLIENT_GONE:
                return None
            else:
                answer = _denied(config, result)
            envelope.status = answer[0]
            return answer

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = await self(scope, receive)
        if answer is not None:
            await send_answer(send, answer)


def _denied(config: Config, answer: Answer) -> tuple[int, Headers, bytes]:
    headers = list(answer.headers)
    if answer.close:
        headers.append((b"connection", b"close"))
    if config.check_deny_status is None:
        return answer.status, headers, answer.body
    headers.append((b"x-ratelimit-status", str(answer.status).encode()))
    return config.check_deny_status, headers, answer.body


class Asked:
    """The request a check asks about, as `check.convention` names it (gateway/http/request.py
    `Original`): read_request reads it in its one pass over the headers, taking the fields of every
    convention out of the request the pipeline sees, whichever is read. Its fields are refused
    (BadRequest, nothing counted) when sent twice, when the method is not a token, and when the
    URI is not a path. `method` and `target` keep what was read, for the access log."""

    fields = CONVENTION
    __slots__ = ("convention", "method", "path_prefix", "target")

    def __init__(self, path_prefix: str = "", convention: str = "auto") -> None:
        self.path_prefix = path_prefix
        self.convention = convention
        self.method = ""
        self.target = b""

    def spelled(self, name: bytes) -> str:
        return _NAMES[name]

    def logged(self, scope: Scope) -> Scope:
        """What the access log reads of the request asked about (the asking one's, if not read)."""
        if not self.method:
            return scope
        path = self.target.partition(b"?")[0].decode("latin-1")
        return {"method": self.method, "path": unquote(path) if "%" in path else path, "client": scope.get("client")}

    def read(self, one: dict[bytes, bytes], scope: MutableMapping[str, Any]) -> tuple[str, bytes, bytes | None, str]:
        convention = self.convention
        if convention == "auto":
            if FORWARDED_URI in one or FORWARDED_METHOD in one:
                convention = "forwarded"
            elif ORIGINAL_URI in one or ORIGINAL_URL in one or ORIGINAL_METHOD in one:
                convention = "original"
        host = one.get(FORWARDED_HOST) if convention != "request_line" else None
        if convention == "forwarded":
            target = _required(one, FORWARDED_URI)
            method = _required(one, FORWARDED_METHOD)
        elif convention == "original":
            method = _required(one, ORIGINAL_METHOD)
            target = one.get(ORIGINAL_URI, b"")
            if ORIGINAL_URL in one:  # ingress-nginx: scheme://host/path?query
                # ingress-nginx passes the client's own fields along: beside the URL it writes, a
                # different X-Original-URI or X-Forwarded-Host would choose what is counted
                url_host, url_target = _absolute(one[ORIGINAL_URL])
                if target and target != url_target:
                    raise BadRequest("X-Original-URI and X-Original-URL name different requests")
                if host and url_host and host.lower() != url_host.lower():
                    raise BadRequest("X-Forwarded-Host and X-Original-URL name different hosts")
                host, target = url_host, url_target
            if not target:
                raise BadRequest("X-Original-URI (or X-Original-URL) is missing")
        else:  # Envoy ext_authz: the request line is the original's, behind check.path_prefix
            method = scope["method"].encode()
            target = scope.get("raw_path") or scope["path"].encode()
            query = scope.get("query_string") or b""
            if self.path_prefix:
                prefix = self.path_prefix.encode()
                if not target.startswith(prefix) or target[len(prefix):][:1] not in (b"/", b""):
                    raise BadRequest(f"the check path must start with check.path_prefix {self.path_prefix}")
                target = target[len(prefix):] or b"/"
            if query:
                target += b"?" + query
        if not _METHOD.match(method):
            raise BadRequest("the original method is not an HTTP method")
        if not target.startswith(b"/"):
            raise BadRequest("the original request target must be a path starting with / (origin-form)")
        self.method = method.decode("ascii").upper()
        self.target = target
        proto = one.get(FORWARDED_PROTO, b"").lower()
        scheme = proto.decode() if proto in (b"http", b"https") else scope.get("scheme", "http")
        return self.method, target, host, scheme


def _required(one: dict[bytes, bytes], name: bytes) -> bytes:
    value = one.get(name)
    if not value:
        raise BadRequest(f"{_NAMES[name]} is missing")
    return value


def _absolute(url: bytes) -> tuple[bytes | None, bytes]:
    """The host and origin-form target of an absolute http(s) URL."""
    try:
        parts = urlsplit(url.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("X-Original-URL is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc:
        raise BadRequest("X-Original-URL must be an absolute http(s) URL")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.netloc.encode(), target.encode()

