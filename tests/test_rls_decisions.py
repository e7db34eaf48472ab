"""The RLS port decides on the one decision step the other doors use (gateway/decision.py): the same
per-rule accounting for a refusal Redis gave and one answered again from memory. Before, the RLS
counted only Redis's, so a flood answered from memory vanished from gateway_rule_decisions_total,
while the proxy port counted it. A real gateway process, a real Redis, grpcio's client."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.rls_client import RlsClient
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """\
version: 1
upstreams: {up: {url: "http://127.0.0.1:9"}}
routes:
  - name: http
    match: {path: /x}
    upstream: up
    limits: [{name: once, by: ["header:X-User"], algorithm: fixed_window, limit: 1, window: 1h}]
rls:
  domains:
    d:
      descriptors:
        - key: user
          limit: {name: once, algorithm: fixed_window, limit: 1, window: 1h}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess) -> Iterator[GatewayProcess]:
    port = free_port()
    process = GatewayProcess(CONFIG, tmp_path_factory.mktemp("rls-decisions"), redis_url=redis_proc.url,
                             args=("--rls-port", str(port)))
    process.rls_port = port  # type: ignore[attr-defined]
    process.start()
    try:
        yield process
    finally:
        assert process.stop() == 0
    assert "Traceback" not in process.log()


def counted(gateway: GatewayProcess, route: str, outcome: str, decided_by: str) -> float:
    text = httpx.get(gateway.admin_url + "/metrics").text
    pattern = (rf'gateway_rule_decisions_total\{{(?=[^}}]*decided_by="{decided_by}")(?=[^}}]*outcome="{outcome}")'
               rf'(?=[^}}]*route="{re.escape(route)}")(?=[^}}]*rule="once")[^}}]*\}} ([0-9.e+]+)')
    return sum(float(m.group(1)) for m in re.finditer(pattern, text))


def test_refusals_from_memory_are_counted_per_rule_on_the_rls_port_as_on_the_proxy_port(
        gateway: GatewayProcess) -> None:
    client = RlsClient(gateway.rls_port)  # type: ignore[attr-defined]
    user = f"u{random.getrandbits(40):x}"
    try:
        codes = [client.ask("d", [("user", user)]).overall_code for _ in range(5)]
    finally:
        client.close()
    assert codes == [1, 2, 2, 2, 2]  # OK, then OVER_LIMIT
    for _ in range(5):
        httpx.get(f"{gateway.url}/x", headers={"X-User": user})
    wait_until(lambda: counted(gateway, "http", "refused", "memory") >= 3, timeout=10)
    wait_until(lambda: counted(gateway, "rls.d", "refused", "redis") >= 1, timeout=10)
    # the first refusal is Redis's; the ones after it are answered from memory, on both doors
    wait_until(lambda: counted(gateway, "rls.d", "refused", "memory") >= 3, timeout=10)
    assert counted(gateway, "rls.d", "refused", "memory") == counted(gateway, "http", "refused", "memory")

