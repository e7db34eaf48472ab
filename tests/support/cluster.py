"""A real Redis Cluster of three primaries (the pip-shipped 6.2 server), built with redis-cli;
optionally with a replica per primary (six processes), for failovers."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import redis

from gateway.embedded import redis_server_binary
from tests.support.ports import free_cluster_port
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until


class RedisCluster:
    def __init__(self, size: int = 3, replicas: int = 0, binary: str | None = None) -> None:
        self.replicas = replicas
        self.binary = binary or redis_server_binary()
        self.nodes = [
            RedisProcess(binary=binary, extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                     "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"),
                         port=free_cluster_port())
            for _ in range(size * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            cli = str(Path(self.binary).with_name("redis-cli"))
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=60)
            wait_until(self.healthy, timeout=30)
        except BaseException:
            self.stop()  # no node left running behind a failed start
            raise

    def live(self) -> list[RedisProcess]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def healthy(self) -> bool:
        for node in self.live():
            info = node.client().execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info:
                return False
        return True

    def replica_of(self, primary: RedisProcess) -> RedisProcess:
        primary_id = primary.client().execute_command("CLUSTER", "MYID").decode()
        for node in self.live():
            role = node.client().execute_command("ROLE")
            if role[0] == b"slave" and int(role[2]) == primary.port:
                return node
        raise AssertionError(f"no replica of {primary_id}")

    def owner_of(self, key: str) -> RedisProcess:
        return self.owner_of_slot(int(self.live()[0].client().execute_command("CLUSTER", "KEYSLOT", key)))

    def owner_of_slot(self, slot: int) -> RedisProcess:
        for node in self.live():
            for start, end, primary, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end and int(primary[1]) == node.port:
                    return node
        raise AssertionError(f"no owner for slot {slot}")

    def migrate_slot(self, slot: int, started: threading.Event | None = None, batch: int = 10) -> None:
        """What `redis-cli --cluster reshard` does for one slot: IMPORTING on the target, MIGRATING
        on the source, MIGRATE the keys `batch` at a time (decisions run in between: ASK,
        TRYAGAIN), then SETSLOT NODE on the target, the source and the rest."""
        primaries = self.primaries()
        ids = {n.port: n.client().execute_command("CLUSTER", "MYID").decode() for n in primaries}
        source = self.owner_of_slot(slot)
        target = next(n for n in primaries if n.port != source.port)
        src, dst = source.client(), target.client()
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
        if started is not None:
            started.set()
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            time.sleep(0.003)
        for node in [target, source] + [n for n in primaries if n.port not in (source.port, target.port)]:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])

    def primaries(self) -> list[RedisProcess]:
        return [n for n in self.live() if n.client().execute_command("ROLE")[0] == b"master"]

    def client_for(self, key: str) -> redis.Redis:
        return self.owner_of(key).client()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
