"""What every admin endpoint shares: the gateway it controls, problem answers, who may write, a
bounded body, the configuration in force."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import unquote_to_bytes

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.responses import problem

if TYPE_CHECKING:
    from gateway.plan import RoutePlan
    from gateway.runtime import Runtime
    from gateway.settings import Settings
    from gateway.top import TopRefused


class AdminControl(Protocol):
    """What the admin port needs from the gateway (gateway.lifecycle.Lifecycle is one)."""

    @property
    def runtime(self) -> Runtime | None: ...

    @property
    def top(self) -> TopRefused: ...

    @property
    def ready(self) -> bool: ...

    @property
    def settings(self) -> Settings: ...

    def reload(self) -> tuple[bool, str]: ...

    def next_reload(self) -> asyncio.Future[tuple[bool, str]]: ...


def problem_response(status: int, detail: str, headers: Mapping[str, str] | None = None, **extra: Any) -> Response:
    _, _, body = problem(status, detail, **extra)
    return Response(body, status_code=status, headers=headers, media_type="application/problem+json")


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def write_refusal(control: AdminControl, request: Request) -> Response | None:
    """None when this admin write may proceed, else the answer that refuses it."""
    runtime = control.runtime
    token = runtime.config.admin_token if runtime else None
    if token:
        # the scheme in any case (RFC 9110 11.1), the token without the whitespace around it
        scheme, _, given = request.headers.get("authorization", "").strip(" \t").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.lstrip(" ").encode("latin-1"), token.encode()):
            return None
        return problem_response(401, "admin token required: Authorization: Bearer <admin.token>",
                                headers={"WWW-Authenticate": 'Bearer realm="gateway-admin"'})
    peer = request.client.host if request.client else None
    if not is_loopback(peer):
        return problem_response(403, "admin writes without admin.token are accepted from loopback only; "
                                     "set admin.token to allow them from elsewhere")
    # From loopback, a browser may still be the one asking: a page elsewhere posting to 127.0.0.1
    # (CSRF: it names its own Origin), or a hostile name rebound to 127.0.0.1 (its Host is that name)
    host = request.headers.get("host", "")
    if not is_loopback_host(host):
        return problem_response(403, "admin writes without admin.token need a loopback Host "
                                     "(localhost, 127.0.0.1 or [::1]); set admin.token to allow others")
    origin = request.headers.get("origin")
    if origin is not None and origin.lower() != f"{request.url.scheme}://{host}".lower():
        return problem_response(403, "admin writes without admin.token are not accepted from another site's page")
    return None


def is_loopback_host(host: str) -> bool:
    """A Host field naming this machine: localhost or a loopback address, with an optional port."""
    name, port = host, ""
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return False
        port = port[1:]
    elif ":" in host:
        name, _, port = host.rpartition(":")
    if port and not (port.isdigit() and port.isascii()):
        return False
    return name.lower() == "localhost" or is_loopback(name)


MAX_OVERRIDE_BODY = 4096  # bytes
ADMIN_BODY_TIMEOUT = 5.0  # seconds for an admin body (at most MAX_OVERRIDE_BODY) to arrive whole


class TooLarge(Exception):
    pass


async def bounded_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, read no further than `limit` bytes (a larger declared length is refused before
    any of it is read) and within `timeout`. Raises TooLarge or TimeoutError."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise TooLarge
    body = bytearray()
    async with asyncio.timeout(timeout):
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise TooLarge
    return bytes(body)


async def admin_body(request: Request, limit: int) -> bytes | Response:
    """The body of an admin write (`bounded_body` within ADMIN_BODY_TIMEOUT), or the answer that
    refuses it: 413 past `limit`, 408 when it stalls; both close the connection, the rest unread."""
    try:
        return await bounded_body(request, limit, ADMIN_BODY_TIMEOUT)
    except TooLarge:
        response = problem_response(413, f"the body is at most {limit} bytes")
    except TimeoutError:
        response = problem_response(408, f"the body did not arrive within {ADMIN_BODY_TIMEOUT:.0f}s")
    response.headers["connection"] = "close"
    return response


def json_text(raw: bytes) -> Any:
    """An admin write's JSON body. Raises ValueError (RecursionError when nested thousands deep),
    also for an escaped lone surrogate ("\\ud800"): JSON lets one through, but it is not text, and
    it would fail where the value is stored or shown."""
    value = json.loads(raw)
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate (an escaped \\ud800-\\udfff), which is not text") from None
    return value


MAX_CURSOR = 2**64  # Redis's SCAN cursors are unsigned 64-bit numbers


def is_cursor(text: str) -> bool:
    """A cursor Redis can take: ASCII digits (str.isdigit() also takes '²') below 2**64."""
    return text.isascii() and text.isdigit() and len(text) <= 20 and int(text) < MAX_CURSOR


def query_bytes(request: Request, name: str) -> list[bytes]:
    """Every value of one query parameter as the bytes it escapes: `%FF` is the byte 0xFF, where
    Starlette's query_params decode it as UTF-8 and would make it U+FFFD."""
    wanted = name.encode()
    values = []
    for pair in request.scope.get("query_string", b"").split(b"&"):
        key, _, value = pair.partition(b"=")
        if unquote_to_bytes(key.replace(b"+", b" ")) == wanted:
            values.append(unquote_to_bytes(value.replace(b"+", b" ")))
    return values


def runtime_of(control: AdminControl) -> Runtime:
    runtime = control.runtime
    if runtime is None:
        raise HTTPException(503, "configuration not loaded yet")
    return runtime


A = TypeVar("A")
T = TypeVar("T")
SHARD_CALLS = 32  # admin calls in flight at once for a split rule's shards


async def each(items: Sequence[A], call: Callable[[A], Awaitable[T]]) -> list[T]:
    """`call` for every item (one per shard), a few dozen at a time; the results in order."""
    out: list[T] = []
    for start in range(0, len(items), SHARD_CALLS):
        out.extend(await asyncio.gather(*(call(item) for item in items[start:start + SHARD_CALLS])))
    return out


def route_rule(runtime: Runtime, request: Request) -> tuple[RoutePlan, int] | Response:
    """The route and the index of the rule a `/{route}/{rule}` path names, or its 404."""
    route_name, rule_name = request.path_params["route"], request.path_params["rule"]
    plan = runtime.plans.get(route_name)
    if plan is None:
        return problem_response(404, f"no route {route_name[:100]!r}")
    index = next((i for i, r in enumerate(plan.rules) if r.name == rule_name), None)
    if index is None:
        return problem_response(404, f"route {route_name!r} has no rule {rule_name[:100]!r}")
    return plan, index


def control_of(request: Request) -> AdminControl:
    """The gateway the admin app reports on and acts for (`admin_app` keeps it in the app's state)."""
    control: AdminControl = request.app.state.control
    return control
