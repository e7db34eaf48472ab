"""A real Redis Cluster of three primaries (the pip-shipped 6.2 server), built with redis-cli."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from gateway.embedded import redis_server_binary
from tests.support.ports import free_cluster_port
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until


class RedisCluster:
    def __init__(self, size: int = 3) -> None:
        self.nodes = [
            RedisProcess(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                     "--cluster-node-timeout", "2000"), port=free_cluster_port())
            for _ in range(size)
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = str(Path(redis_server_binary()).with_name("redis-cli"))
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_until(self.healthy, timeout=30)

    def healthy(self) -> bool:
        for node in self.nodes:
            info = node.client().execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info:
                return False
        return True

    def owner_of(self, key: str) -> RedisProcess:
        client = self.nodes[0].client()
        slot = client.execute_command("CLUSTER", "KEYSLOT", key)
        for node in self.nodes:
            slots = node.client().execute_command("CLUSTER", "SLOTS")
            port = node.port
            for start, end, primary, *_ in slots:
                if start <= slot <= end and int(primary[1]) == port:
                    return node
        raise AssertionError(f"no owner for {key}")

    def client_for(self, key: str) -> redis.Redis:
        return self.owner_of(key).client()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
