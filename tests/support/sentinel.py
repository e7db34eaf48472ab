"""A real redis-server in sentinel mode, watching one primary (quorum 1, down after 1 s)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.embedded import redis_server_binary
from tests.support.orphans import started
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until


class Sentinel(RedisProcess):
    def __init__(self, primary_port: int, directory: Path) -> None:
        self.conf = directory / "sentinel.conf"
        self.conf.write_text(
            f"sentinel monitor mymaster 127.0.0.1 {primary_port} 1\n"
            "sentinel down-after-milliseconds mymaster 1000\n"
            "sentinel failover-timeout mymaster 5000\n"
        )
        super().__init__()
        self.extra_args = ("--sentinel",)

    def start(self, wait: float = 10.0) -> None:
        self.process = started(
            [redis_server_binary(), str(self.conf), "--sentinel", "--port", str(self.port),
             "--bind", "127.0.0.1", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        wait_until(lambda: self._answers(), timeout=wait)

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except Exception:
            return False


@contextmanager
def sentinel_topology(directory: Path) -> Iterator[tuple[RedisProcess, RedisProcess, Sentinel]]:
    """A primary, its replica and a sentinel that knows both, stopped on the way out."""
    primary = RedisProcess()
    replica: RedisProcess | None = None
    sentinel: Sentinel | None = None
    try:
        primary.start()
        replica = RedisProcess(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
        replica.start()
        wait_until(lambda: primary.client().info("replication")["connected_slaves"] == 1)
        sentinel = Sentinel(primary.port, directory)
        sentinel.start()
        known = sentinel
        wait_until(lambda: _known_replicas(known) >= 1, timeout=30)
        yield primary, replica, sentinel
    finally:
        for proc in (sentinel, replica, primary):
            if proc is not None:
                proc.stop()


def _known_replicas(sentinel: Sentinel) -> int:
    replicas = sentinel.client().execute_command("SENTINEL", "REPLICAS", "mymaster")
    healthy = 0
    for entry in replicas:
        # a raw reply: a flat [name, value, ...] list per replica, or a map (RESP3 / a response
        # callback), with bytes or str names, so its values have no static type
        fields: Any = dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
        flags = fields.get(b"flags", fields.get("flags", b""))
        link = fields.get(b"master-link-status", fields.get("master-link-status", b""))
        if b"s_down" not in flags and link in (b"ok", "ok"):
            healthy += 1
    return healthy
