"""OpenTelemetry traces, off unless OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER says otherwise.

Each request on the proxy and check ports, and each call on the RLS port, is a SERVER span, a child of the client's W3C
`traceparent` when it sent one; its decision's Redis call is a child span, and so is the exchange
with the upstream, whose request carries a `traceparent` naming that span (the client's trace id).
Attributes: the route and its path template, the route's rules, the outcome, `decided_by`, the
refusing rule, the status. Never a header value, a key, an identity or the query: nothing secret.

The hooks are installed when the gateway is put together (gateway/app.py, gateway/runtime.py,
gateway/proxy.py): with tracing off each returns what it was given, so a request meets no tracing
code at all. Where the spans go (endpoint, headers, sampler, service name, batch delays) is the
SDK's `OTEL_*` variables'.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.settings import opentelemetry

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("gateway.tracing")
# what the hooks are given, by type (this module imports none of the gateway's: they import it)
A = TypeVar("A")  # an Accounting
L = TypeVar("L")  # a Limiter
U = TypeVar("U")  # a unary gRPC handler: message bytes -> answer bytes
D = TypeVar("D")  # a Door: (scope, receive) -> its whole answer


def _wanted() -> bool:
    if opentelemetry("OTEL_SDK_DISABLED").strip().lower() == "true":
        return False
    exporter = opentelemetry("OTEL_TRACES_EXPORTER").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(opentelemetry("OTEL_EXPORTER_OTLP_ENDPOINT") or opentelemetry("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


ON = _wanted()
# the W3C trace context fields: the client's are read; the upstream gets ours in their place
_CONTEXT_FIELDS = (b"traceparent", b"tracestate")


@functools.cache
def tracer() -> Tracer:
    """The worker's tracer, its provider and exporter made on first use (in the worker process: the
    batch processor's thread does not survive a fork)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create({SERVICE_NAME: opentelemetry("OTEL_SERVICE_NAME", "ratelimit-gateway")})
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER (default: the parent's)
    exporter: SpanExporter
    kind = opentelemetry("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        exporter = ConsoleSpanExporter()
    else:
        if kind not in ("otlp", "otlp_proto_http"):
            log.warning("OTEL_TRACES_EXPORTER=%s: this gateway exports OTLP over HTTP (otlp) or to the console; "
                        "using otlp", kind)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT, ...
    provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* say how often
    trace.set_tracer_provider(provider)
    return provider.get_tracer("gateway")


# ---- the request's span -------------------------------------------------------------------------


def _client_context(scope: Scope) -> Any:
    """The client's trace context from its traceparent/tracestate (or none: a new trace)."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        if name in _CONTEXT_FIELDS and name.decode() not in carrier:
            carrier[name.decode()] = value.decode("latin-1")
    return propagate.extract(carrier)


def served(app: ASGIApp, port: str) -> ASGIApp:
    """`app` (the proxy or check endpoint) with a span per request; `app` itself when tracing is off.
    An `answer_early` of the app (the server's early path: a refusal held in memory, answered before
    the app is entered) makes its span too."""
    if not ON:
        return app
    from opentelemetry.trace import SpanKind

    async def traced(scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method", "")
        with tracer().start_as_current_span(method or "request", context=_client_context(scope), kind=SpanKind.SERVER,
                                            attributes={"http.request.method": method, "gateway.port": port}):
            await app(scope, receive, send)

    early = getattr(app, "answer_early", None)
    if early is not None:

        def answer_early(scope: Scope) -> Any:
            started = time.time_ns()
            reply = early(scope)
            told, _unspanned[0] = _unspanned[0], None
            if reply is not None and told is not None:  # answered here: the span is made after the fact
                method = scope.get("method", "")
                span = tracer().start_span(method or "request", context=_client_context(scope), kind=SpanKind.SERVER,
                                           start_time=started,
                                           attributes={"http.request.method": method, "gateway.port": port})
                _describe(span, *told)
                span.end()
            return reply

        app.answer_early = answer_early  # type: ignore[attr-defined]
    return traced


def door(answer: D, port: str) -> D:
    """A port's door (gateway/http/early.py `Door`) with a span per request; `answer` itself when
    tracing is off."""
    if not ON:
        return answer
    from opentelemetry.trace import SpanKind

    async def traced(scope: Scope, receive: Receive) -> Any:
        method = scope.get("method", "")
        with tracer().start_as_current_span(method or "request", context=_client_context(scope), kind=SpanKind.SERVER,
                                            attributes={"http.request.method": method, "gateway.port": port}):
            return await answer(scope, receive)  # type: ignore[operator]

    return traced  # type: ignore[return-value]


def accounted(accounting: A) -> A:
    """`accounting` that also names the request's span after its route and says how it ended."""
    if not ON:
        return accounting
    from opentelemetry import trace

    account = accounting.account  # type: ignore[attr-defined]

    def traced_account(config: Any, scope: Scope, request_id: bytes, result: Any, status: int,
                       started: float) -> None:
        account(config, scope, request_id, result, status, started)
        span = trace.get_current_span()
        if span.is_recording():
            _describe(span, config, scope, request_id, result, status)
        else:  # the early path, which has no span yet (or a request not sampled)
            _unspanned[0] = (config, scope, request_id, result, status)

    accounting.account = traced_account  # type: ignore[attr-defined]
    return accounting


# what the early path's accounting said, for the span made after it (the event loop's one thread)
_unspanned: list[tuple[Any, Scope, bytes, Any, int] | None] = [None]


def _describe(span: Any, config: Any, scope: Scope, request_id: bytes, result: Any, status: int) -> None:
    from opentelemetry.trace import StatusCode

    route = _route(config, result.route)
    method = scope.get("method", "")
    if route is not None:
        span.update_name(f"{method} {route.path}" if route.path else f"{method} {route.name}")
        span.set_attributes({"gateway.route": route.name, "gateway.rules": [r.name for r in route.limits]})
        if route.path:
            span.set_attribute("http.route", route.path)
    span.set_attributes({"gateway.outcome": str(result.outcome), "gateway.decided_by": str(result.decided_by),
                         "http.response.status_code": status, "gateway.request_id": request_id.decode("latin-1")})
    if getattr(result, "rule", ""):
        span.set_attribute("gateway.rule", result.rule)
    if status >= 500:
        span.set_status(StatusCode.ERROR)


_routes: tuple[int, dict[str, Any]] = (0, {})


def _route(config: Any, name: str) -> Any:
    global _routes
    if _routes[0] != id(config):
        _routes = (id(config), {route.name: route for route in config.routes})
    return _routes[1].get(name) if name else None


# ---- the decision's Redis call --------------------------------------------------------------------


def limiter(made: L) -> L:
    """`made` with a span around each decision's Redis call."""
    if not ON:
        return made
    from opentelemetry.trace import SpanKind, StatusCode, get_current_span

    decide = made.decide  # type: ignore[attr-defined]

    async def traced_decide(rules: Any, keys: list[str], costs: Any, peek: bool = False, **options: Any) -> Any:
        if not get_current_span().is_recording():  # a request not sampled (or the admin's peek): no span
            return await decide(rules, keys, costs, peek, **options)
        with tracer().start_as_current_span("gateway.decision", kind=SpanKind.CLIENT, attributes={
                "db.system.name": "redis", "gateway.rules_checked": len(rules), "gateway.peek": peek}) as span:
            try:
                decision = await decide(rules, keys, costs, peek, **options)
            except Exception as exc:
                span.set_status(StatusCode.ERROR, exc.__class__.__name__)
                span.set_attribute("error.type", exc.__class__.__name__)  # never the message: it may name a key
                raise
            span.set_attribute("gateway.admitted", decision.admitted)
            return decision

    made.decide = traced_decide  # type: ignore[attr-defined]
    return made


# ---- the RLS port's calls -------------------------------------------------------------------------

# the trace context (traceparent, tracestate) of the RLS call being served: its gRPC metadata, set by
# the server (gateway/rls/server.py) for the call's task, and only while traces are on
CALL_CONTEXT: ContextVar[tuple[bytes, bytes] | None] = ContextVar("gateway_rls_call_context", default=None)
_RLS_OUTCOMES = {b"\x08\x01": "ok", b"\x08\x02": "over_limit"}  # RateLimitResponse.overall_code, its first field


def rls_call(handler: U) -> U:
    """The RLS port's ShouldRateLimit with a span per call, a child of Envoy's traceparent; the
    decision's Redis call is its child (the limiter's span). `handler` itself when tracing is off."""
    if not ON:
        return handler
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind, StatusCode

    async def traced(message: bytes) -> bytes:
        sent = CALL_CONTEXT.get()
        carrier = {} if sent is None else {k: v.decode("latin-1") for k, v in zip(("traceparent", "tracestate"), sent,
                                                                                   strict=True) if v}
        with tracer().start_as_current_span(
                "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", context=propagate.extract(carrier),
                kind=SpanKind.SERVER, attributes={"rpc.system": "grpc", "gateway.port": "rls",
                                                  "rpc.service": "envoy.service.ratelimit.v3.RateLimitService",
                                                  "rpc.method": "ShouldRateLimit"}) as span:
            try:
                answer = await handler(message)  # type: ignore[operator]
            except Exception as exc:
                status = getattr(exc, "status", 2)  # a GrpcError's status; any other: UNKNOWN
                span.set_attribute("rpc.grpc.status_code", status)
                span.set_status(StatusCode.ERROR, exc.__class__.__name__)
                raise
            span.set_attribute("rpc.grpc.status_code", 0)
            span.set_attribute("gateway.outcome", _RLS_OUTCOMES.get(bytes(answer[:2]), "unknown"))
            return bytes(answer)

    return traced  # type: ignore[return-value]


# ---- the upstream exchange ------------------------------------------------------------------------


def upstream(client: Any) -> None:
    """`client.forward` in a span of its own, the request carrying that span's trace context."""
    if not ON:
        return
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind, StatusCode, get_current_span

    forward = client.forward
    name = client.upstream.name
    address = client.url.host

    def passed_on(request: Any) -> Any:
        """`request` with the current span's trace context in place of the client's."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return replace(request, headers=[*_without_context(request.headers),
                                         *((k.encode(), v.encode("latin-1")) for k, v in carrier.items())])

    async def traced_forward(request: Any, *args: Any, **kwargs: Any) -> Any:
        if not get_current_span().is_recording():  # not sampled: no span, the decision passed on
            return await forward(passed_on(request), *args, **kwargs)
        with tracer().start_as_current_span(f"{request.method} upstream {name}", kind=SpanKind.CLIENT, attributes={
                "http.request.method": request.method, "server.address": address,
                "gateway.upstream": name}) as span:
            request = passed_on(request)
            try:
                forwarded = await forward(request, *args, **kwargs)
            except Exception as exc:
                span.set_status(StatusCode.ERROR, exc.__class__.__name__)
                span.set_attribute("error.type", exc.__class__.__name__)
                raise
            span.set_attribute("http.response.status_code", forwarded.status)
            if forwarded.aborted or forwarded.status >= 500:
                span.set_status(StatusCode.ERROR)
            return forwarded

    client.forward = traced_forward


def _without_context(headers: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    for name, value in headers:
        if name.lower() not in _CONTEXT_FIELDS:
            yield name, value
