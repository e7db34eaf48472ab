"""The conformance suite's gateway: a real process for every server protocol and every upstream
transport the gateway ships, in front of one logging upstream."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conformance.upstream import LoggingUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess

# our httptools protocol and uvicorn's own; ours and httpx.AsyncHTTPTransport (tests.support.comparison_gateway)
SERVERS = ("gateway", "uvicorn")
TRANSPORTS = ("lean", "httpx")

CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "http://{upstream}", timeout: 2s}}
  few: {{url: "http://{upstream}", timeout: 2s, max_connections: 4, connect_timeout: 500ms}}
routes:
  - name: limited
    match: {{path: "/limited/{{run}}/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: hourly, by: ["path:run"], algorithm: fixed_window, limit: 1, window: 1h}}
  - name: limited-user
    match: {{path: "/limited-user/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: hourly, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 1, window: 1h}}
  - name: user
    match: {{path: "/user/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: user, by: ["header:X-User-Id"], algorithm: sliding_window, limit: 100000, window: 1m}}
  - name: digest
    match: {{path: "/digest/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: once, by: [body], algorithm: sliding_log, limit: 1000, window: 1s}}
  - name: hosted
    match: {{host: elsewhere, path: "/hosted/{{rest:path}}"}}
    upstream: up
  - name: open
    match: {{path: "/open/{{rest:path}}"}}
    upstream: up
  - name: pooled
    match: {{path: "/pooled/{{rest:path}}"}}
    upstream: few
"""


@dataclass(frozen=True)
class Deployed:
    proc: GatewayProcess
    server: str
    transport: str

    @property
    def port(self) -> int:
        return self.proc.port


@pytest.fixture(scope="session")
def logging_upstream() -> Iterator[LoggingUpstream]:
    upstream = LoggingUpstream()
    upstream.start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="session", params=[(s, t) for s in SERVERS for t in TRANSPORTS],
                ids=[f"{s}-server+{t}-transport" for s in SERVERS for t in TRANSPORTS])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            redis_proc: RedisProcess, logging_upstream: LoggingUpstream) -> Iterator[Deployed]:
    server, transport = request.param
    text = CONFIG.format(prefix=f"c{uuid.uuid4().hex[:8]}", upstream=logging_upstream.address)
    proc = GatewayProcess(text, tmp_path_factory.mktemp("conformance"), redis_url=redis_proc.url,
                          env={"GATEWAY_BODY_TIMEOUT": "1"}, http=server, transport=transport)
    proc.start()
    yield Deployed(proc, server, transport)
    assert proc.stop() == 0
    tracebacks = proc.log().split("Traceback (most recent call last):")[1:]
    if server == "uvicorn":  # its protocol closes the connection for a malformed pipelined request, then
        # the app answering the request before it writes to the closed transport (pipelined-then-malformed)
        tracebacks = [t for t in tracebacks if "RuntimeError: unable to perform operation on <TCPTransport closed=True"
                      not in t.split("Exception in ASGI application")[0]]
    assert not tracebacks, proc.log()
