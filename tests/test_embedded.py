"""The embedded Redis keeps what the admin port wrote across a plain restart: with no Redis URL and
no flag, its state lives in a per-user state directory keyed by the config file's path (named in
the start-up line); --ephemeral keeps it in memory only, and a write says so."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx

from gateway.api_keys import digest, fingerprint
from tests.support.gateway_proc import GatewayProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

CONFIG = """
version: 1
keys: {{source: "header:X-Api-Key", plans: [free]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: api
    match: {{path: /echo/api}}
    upstream: up
    limits: [{{name: per-key, by: ["header:X-Api-Key"], algorithm: quota, limit: 3}}]
"""


def _status(gateway: GatewayProcess, key: str) -> int:
    return httpx.get(gateway.url + "/echo/api", headers={"X-Api-Key": key}).status_code


def _restarted(gateway: GatewayProcess) -> GatewayProcess:
    assert gateway.stop() == 0
    again = GatewayProcess(gateway.config_path.read_text(), gateway.config_path.parent, args=gateway.extra_args)
    again.start()
    return again


def test_keys_overrides_and_counts_survive_a_plain_restart(tmp_path: Path, upstream: Upstream) -> None:
    gateway = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path)
    gateway.start()
    key = "sk_" + uuid.uuid4().hex
    try:
        with httpx.Client(base_url=gateway.admin_url) as admin:
            put = admin.put("/keys", params={"key": key}, json={"plan": "free"})
            assert put.status_code == 200 and "warning" not in put.json()
            other = admin.put("/overrides/api/per-key", params={"key": "sk_other"}, json={"limit": 10})
            assert other.status_code == 200 and "warning" not in other.json()
        wait_until(lambda: _status(gateway, key) == 200, timeout=2.0)
        assert _status(gateway, key) == 200  # 2 of 3 spent
        state = tmp_path / "state" / "ratelimit-gateway"
        [directory] = list(state.iterdir())
        assert str(directory) in gateway.log()  # the start-up line names it
        gateway = _restarted(gateway)
        wait_until(lambda: gateway.ready(), timeout=5)
        assert [_status(gateway, key) for _ in range(2)] == [200, 429]  # the key, and its count, kept
        listed = httpx.get(gateway.admin_url + "/overrides/api/per-key").json()["overrides"]
        assert [entry["key"] for entry in listed] == [fingerprint(digest(b"sk_other"))]
    finally:
        assert gateway.stop() == 0


def test_ephemeral_keeps_nothing_and_a_write_says_so(tmp_path: Path, upstream: Upstream) -> None:
    gateway = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path, args=("--ephemeral",))
    gateway.start()
    key = "sk_" + uuid.uuid4().hex
    try:
        put = httpx.put(gateway.admin_url + "/keys", params={"key": key}, json={"plan": "free"})
        assert put.status_code == 200 and put.json()["survives_restart"] is False, put.text
        assert "--ephemeral" in put.json()["warning"]
        wait_until(lambda: _status(gateway, key) == 200, timeout=2.0)
        assert "in memory only" in gateway.log()
        gateway = _restarted(gateway)
        assert _status(gateway, key) == 401
        assert not (tmp_path / "state").exists()
    finally:
        assert gateway.stop() == 0


def test_a_default_state_directory_that_cannot_be_made_is_memory_said_aloud(tmp_path: Path,
                                                                           upstream: Upstream) -> None:
    """A container whose user has no home (the image's): the gateway starts, keeping state in memory,
    and says so at start and in each write's answer."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    gateway = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path, env={"XDG_STATE_HOME": str(blocked)})
    gateway.start()
    try:
        put = httpx.put(gateway.admin_url + "/keys", params={"key": "k1"}, json={"plan": "free"})
        assert put.status_code == 200 and put.json()["survives_restart"] is False, put.text
        assert "cannot make the embedded Redis's state directory" in gateway.log()
    finally:
        assert gateway.stop() == 0
