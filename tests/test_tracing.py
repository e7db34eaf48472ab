"""OpenTelemetry traces from a real gateway process to a real OTLP/HTTP receiver started here (an
HTTP server decoding the protobuf bodies with opentelemetry-proto): a span per request, the client's
traceparent its parent, child spans for the decision's Redis call and the upstream exchange, the
upstream given a traceparent of the client's trace, and nothing secret in any attribute."""

from __future__ import annotations

import gzip
import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

SERVER = "GET /echo/{rest:path}"  # the request's span: its method and its route's path
SECRET_USER = "user-" + secrets.token_hex(8)
SECRET_TOKEN = "sekrit-" + secrets.token_hex(8)
CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}"}}
routes:
  - name: api
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 1, window: 1h}}
"""


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver: every span it is sent, and a condition notified on each export."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.resources: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                receiver.take(request)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.arrived:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                self.resources.append(resource)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "kind": span.kind, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        })
            self.arrived.notify_all()

    def wait_for(self, trace_id: str, names: set[str]) -> dict[str, dict[str, Any]]:
        """The spans of `trace_id` by name, once every one of `names` has arrived."""
        def found() -> dict[str, dict[str, Any]]:
            return {s["name"]: s for s in self.spans if s["trace_id"] == trace_id}

        with self.arrived:
            if not self.arrived.wait_for(lambda: names <= found().keys(), timeout=within(15)):
                raise TimeoutError(f"not all of {names} of trace {trace_id} arrived: {self.spans}")
            return found()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def traced_gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, env: dict[str, str]) -> GatewayProcess:
    text = CONFIG.format(prefix=f"tr{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    return GatewayProcess(text, tmp_path, redis_url=redis_proc.url, workers=1, env=env)


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def upstream_traceparent(answer: httpx.Response) -> str:
    fields = {name.lower(): value for name, value in answer.json()["headers"]}
    return str(fields["traceparent"])


def test_spans_join_the_clients_trace_and_the_upstream_gets_it(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, receiver: Receiver) -> None:
    gateway = traced_gateway(tmp_path, redis_proc, upstream, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "gateway-under-test"})
    gateway.start()
    try:
        trace_id, client_span, header = traceparent()
        headers = {"traceparent": header, "X-User-Id": SECRET_USER, "Authorization": f"Bearer {SECRET_TOKEN}"}
        admitted = httpx.get(f"{gateway.url}/echo/a?token={SECRET_TOKEN}", headers=headers)
        assert admitted.status_code == 200

        spans = receiver.wait_for(trace_id, {SERVER, "gateway.decision", "GET upstream up"})
        server, decision, exchange = spans[SERVER], spans["gateway.decision"], spans["GET upstream up"]
        assert server["kind"] == Span.SPAN_KIND_SERVER and server["parent"] == client_span  # the client's child
        assert decision["parent"] == server["span_id"] and exchange["parent"] == server["span_id"]
        attributes = server["attributes"]
        assert attributes["gateway.route"] == "api"
        assert attributes["gateway.rules"] == ["user"]
        assert attributes["gateway.outcome"] == "admitted"
        assert attributes["gateway.decided_by"] == "redis"
        assert attributes["http.response.status_code"] == 200
        assert exchange["attributes"]["http.response.status_code"] == 200
        assert {"service.name": "gateway-under-test"}.items() <= receiver.resources[0].items()

        # the upstream's request carries the client's trace, its parent the exchange's span
        assert upstream_traceparent(admitted) == f"00-{trace_id}-{exchange['span_id']}-01"

        # a client's trace it did not sample: no spans, and the upstream is told so, in the same trace
        unsampled_id, _, header = traceparent()
        answer = httpx.get(f"{gateway.url}/echo/c", headers={"traceparent": header[:-2] + "00", "X-User-Id": "c"})
        passed = upstream_traceparent(answer).split("-")
        assert passed[1] == unsampled_id and passed[3] == "00"

        refused = httpx.get(f"{gateway.url}/echo/b", headers=headers)
        assert refused.status_code == 429
        trace_id, client_span, header = traceparent()
        refused = httpx.get(f"{gateway.url}/echo/b", headers=headers | {"traceparent": header})
        assert refused.status_code == 429
        spans = receiver.wait_for(trace_id, {SERVER})
        server = spans[SERVER]
        assert "GET upstream up" not in spans
        assert server["parent"] == client_span
        assert server["attributes"]["gateway.outcome"] == "refused"
        assert server["attributes"]["gateway.rule"] == "user"
        assert server["attributes"]["gateway.decided_by"] == "memory"  # the server's early path
        assert server["attributes"]["http.response.status_code"] == 429

        assert not [s for s in receiver.spans if s["trace_id"] == unsampled_id]
        everything = json.dumps(receiver.spans) + json.dumps(receiver.resources)
        assert SECRET_USER not in everything and SECRET_TOKEN not in everything
    finally:
        gateway.stop()


def test_without_otel_variables_the_clients_traceparent_passes_as_sent(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    gateway = traced_gateway(tmp_path, redis_proc, upstream, {})
    gateway.start()
    try:
        _, _, header = traceparent()
        answer = httpx.get(f"{gateway.url}/echo/a", headers={"traceparent": header, "X-User-Id": "u"})
        assert answer.status_code == 200
        assert upstream_traceparent(answer) == header  # forwarded as any end-to-end field
    finally:
        gateway.stop()


def test_the_check_port_makes_its_spans_too(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, receiver: Receiver) -> None:
    check_port = free_port()
    text = CONFIG.format(prefix=f"tr{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    gateway = GatewayProcess(text, tmp_path, redis_url=redis_proc.url, args=("--check-port", str(check_port)), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"})
    gateway.start()
    try:
        trace_id, client_span, header = traceparent()
        answer = httpx.get(f"http://127.0.0.1:{check_port}/", headers={
            "traceparent": header, "X-Forwarded-Method": "GET", "X-Forwarded-Uri": "/echo/a", "X-User-Id": "u"})
        assert answer.status_code == 200
        spans = receiver.wait_for(trace_id, {SERVER, "gateway.decision"})
        server = spans[SERVER]
        assert server["parent"] == client_span and spans["gateway.decision"]["parent"] == server["span_id"]
        assert server["attributes"]["gateway.port"] == "check"
        assert server["attributes"]["gateway.outcome"] == "admitted"
    finally:
        gateway.stop()


RLS_CALL = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


def test_the_rls_port_makes_a_span_per_call_in_envoys_trace(
        tmp_path: Path, redis_proc: RedisProcess, receiver: Receiver) -> None:
    """Envoy's ratelimit filter sends its traceparent as gRPC metadata: the call's span is its
    child, the decision's span the call's; the outcome is an attribute, the descriptors are not."""
    from tests.support.rls_client import RlsClient, request

    rls_port = free_port()
    text = ("version: 1\nrls:\n  domains:\n    d:\n      descriptors:\n        - key: user\n"
            "          limit: {name: once, algorithm: fixed_window, limit: 1, window: 1h}\n")
    gateway = GatewayProcess(text, tmp_path, redis_url=redis_proc.url, args=("--rls-port", str(rls_port)), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"})
    gateway.start()
    client = RlsClient(rls_port)
    try:
        body = request("d", [("user", SECRET_USER)]).SerializeToString()
        traces = []
        for _ in range(2):
            trace_id, client_span, header = traceparent()
            client.raw(body, timeout=5, metadata=[("traceparent", header)])
            traces.append((trace_id, client_span))
        outcomes = []
        for trace_id, client_span in traces:
            spans = receiver.wait_for(trace_id, {RLS_CALL, "gateway.decision"})
            call = spans[RLS_CALL]
            assert call["parent"] == client_span and spans["gateway.decision"]["parent"] == call["span_id"]
            assert call["attributes"]["gateway.port"] == "rls" and call["attributes"]["rpc.grpc.status_code"] == 0
            outcomes.append(call["attributes"]["gateway.outcome"])
        assert outcomes == ["ok", "over_limit"]
        assert SECRET_USER not in json.dumps(receiver.spans)
    finally:
        client.close()
        gateway.stop()
