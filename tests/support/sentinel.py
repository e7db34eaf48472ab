"""A real redis-server in sentinel mode, watching one primary (quorum 1, down after 1 s)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gateway.embedded import redis_server_binary
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
        self.process = subprocess.Popen(
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
