"""The proxy endpoint: one request -> the pipeline -> forwarded to its upstream, or answered.

A pure ASGI callable, routed by the Starlette app (gateway/app.py) for every request that did not
arrive on the admin port. An admitted WebSocket handshake is forwarded with the server's hand-over
of the client connection (the `gateway.upgrade` extension): a 101 from the upstream becomes a tunnel
(gateway/tunnel.py), and the call returns when it closes. `answer_early` is the same endpoint for
the server protocol's early path: a refusal held in memory, answered before the application is
entered (gateway/pipeline.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from starlette.types import Receive, Scope, Send

from gateway import metrics
from gateway.accounting import Accounting
from gateway.admitted import Admitted
from gateway.caller_usage import usage_answer
from gateway.envelope import Envelope
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.outcome import Admit, Answer, RequestBounds, RequestOutcome
from gateway.pipeline import decide, decide_now
from gateway.proxy import ClientDisconnected, ClientTooSlow, HeadHook, RequestBody, Switched
from gateway.request_id import new_request_id, request_id_for
from gateway.responses import Headers, problem, send_answer
from gateway.runtime import Runtime
from gateway.tunnel import switcher, upgrade_acceptor
from gateway.usage import AnswerUsage

Reply = tuple[int, Headers, bytes]


class ProxyEndpoint:
    def __init__(self, current: Callable[[], Runtime | None], limits: RequestBounds, port: int,
                 accounting: Accounting) -> None:
        self.current = current  # the Runtime in force (a reload swaps it)
        self.limits = limits
        self.accounting = accounting
        self.port = port  # requests that arrived on another (admin, check) are not the proxy's

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self.current()
        assert runtime is not None, "the lifespan starts the runtime before any request"
        with Envelope(runtime, self.accounting, scope) as envelope:
            result = envelope.result = await decide(runtime, scope, receive, self.limits, guarded=True)
            if isinstance(result, Answer):
                request_id = envelope.request_id = result.request_id or new_request_id()
                if result.outcome is not RequestOutcome.CLIENT_GONE:
                    envelope.status = await _send(send, result, request_id)
                return
            request_id = envelope.request_id = request_id_for(result.request.request_id)
            async with Admitted(runtime, result) as after:
                if result.plan.route.respond is not None:  # respond: usage, answered here
                    status, headers, body = await usage_answer(runtime, result)
                    status = await _reply(send, (status, [*result.headers, *headers], body), request_id)
                elif result.plan.client is None:  # a route of a file written for the check port
                    detail = f"route '{result.route}' has no upstream: it is decided on the check port"
                    status = await _reply(send, problem(502, detail, route=result.route), request_id)
                elif not after.settles and not result.request.upgrade:  # the common case, directly
                    status = await _forward_as_is(result, receive, send, request_id, self.limits.body_timeout, None)
                else:
                    status = await _forward(after, result, receive, send, request_id, self.limits.body_timeout, scope)
                after.status = envelope.status = status

    def answer_early(self, scope: Scope) -> Reply | None:
        """For the server protocol: the whole answer to a request refused from memory, or None."""
        runtime = self.current()
        server = scope.get("server")
        if runtime is None or server is None or server[1] != self.port:
            return None
        started = time.perf_counter()
        answer = decide_now(runtime, scope, self.limits)
        if answer is None:
            return None
        request_id = answer.request_id or new_request_id()
        self.accounting.account(runtime.config, scope, request_id, answer, answer.status, started)
        return answer.status, [*answer.headers, (b"x-request-id", request_id)], answer.body


async def _send(send: Send, answer: Answer, request_id: bytes) -> int:
    headers = [*answer.headers, (b"x-request-id", request_id)]
    if answer.close:
        headers.append((b"connection", b"close"))
    return await send_answer(send, (answer.status, headers, answer.body))


async def _forward(after: Admitted, admit: Admit, receive: Receive, send: Send, request_id: bytes,
                   body_timeout: float, scope: Scope) -> int:
    switched = None
    if admit.request.upgrade:
        accept = upgrade_acceptor(scope)
        if accept is None:  # a server that cannot hand the connection over (uvicorn's own protocol)
            return await _reply(send, problem(501, "this server cannot switch protocols"), request_id)
        switched = switcher(accept, admit.plan.route.websocket_idle_timeout)
    if not after.settles:
        return await _forward_as_is(admit, receive, send, request_id, body_timeout, None, switched)
    withheld = admit.plan.withheld

    def on_head(status: int, fields: httpx.Headers) -> frozenset[bytes]:
        after.answered(status, fields)  # charged or refunded as the answer's head arrives
        return withheld

    # no head coming (the gateway's own 502, 504, 408, or the client gone): `after` settles the status
    return await _forward_as_is(admit, receive, send, request_id, body_timeout, on_head, switched, after.usage)


async def _forward_as_is(admit: Admit, receive: Receive, send: Send, request_id: bytes, body_timeout: float,
                         on_head: HeadHook | None, switched: Switched | None = None,
                         usage: AnswerUsage | None = None) -> int:
    client = admit.plan.client
    assert client is not None, "a proxied route has an upstream"
    body = None
    if admit.more_body or admit.body_prefix:
        body = RequestBody(admit.body_prefix or b"", admit.more_body, receive, body_timeout)
    response_headers = [*admit.headers, (b"x-request-id", request_id)]
    name = client.upstream.name
    started = time.perf_counter()
    try:
        forwarded = await client.forward(admit.request, body, send, response_headers, request_id, on_head, switched,
                                         usage)
    except UpstreamTimeout as exc:
        if admit.slot is not None:
            admit.slot.timed_out()
        metrics.upstream_errors(name, "timeout").inc()
        return await _reply(send, problem(504, str(exc)), request_id)
    except UpstreamUnavailable as exc:
        metrics.upstream_errors(name, "unavailable").inc()
        return await _reply(send, problem(502, str(exc)), request_id)
    except ClientTooSlow:
        status, headers, data = problem(408, "the request body stopped arriving")
        headers.append((b"connection", b"close"))  # RFC 9110 15.5.9: the server closes after a 408
        return await _reply(send, (status, headers, data), request_id)
    except ClientDisconnected:
        return 499
    elapsed = time.perf_counter() - started
    metrics.upstream_latency(name).observe(elapsed)
    if admit.slot is not None:
        admit.slot.answered(forwarded.status, forwarded.head)
    if forwarded.aborted:
        metrics.upstream_errors(name, "aborted").inc()
    return forwarded.status


async def _reply(send: Send, response: Reply, request_id: bytes) -> int:
    status, headers, body = response
    return await send_answer(send, (status, [*headers, (b"x-request-id", request_id)], body))
