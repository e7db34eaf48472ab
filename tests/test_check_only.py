"""A file written for the check port alone (a `check:` section, no upstreams) serves: the check port
decides its routes, and the proxy port says plainly that they have no upstream."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """
version: 1
redis: {{key_prefix: {prefix}}}
check: {{convention: auto}}
routes:
  - name: search
    match: {{path: /search}}
    limits: [{{name: per-user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 2, window: 1m}}]
"""


def test_a_check_only_file_serves_without_an_upstream(tmp_path: Path, redis_proc: RedisProcess) -> None:
    check_port = free_port()
    gateway = GatewayProcess(CONFIG.format(prefix=f"c{uuid.uuid4().hex[:8]}"), tmp_path, redis_url=redis_proc.url,
                             args=("--check-port", str(check_port)))
    gateway.start()
    try:
        asked = {"X-Original-Method": "GET", "X-Original-URI": "/search?q=1", "X-User-Id": "alice"}
        statuses = [httpx.get(f"http://127.0.0.1:{check_port}/", headers=asked).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        proxied = httpx.get(gateway.url + "/search", headers={"X-User-Id": "bob"})
        assert proxied.status_code == 502 and "check port" in proxied.json()["detail"]
    finally:
        assert gateway.stop() == 0
    assert "Traceback" not in gateway.log()
