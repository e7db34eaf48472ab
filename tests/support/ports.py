"""Free TCP ports on the loopback interface, for the servers the tests start.

They come from below the kernel's ephemeral range (32768 and up here), where no outgoing connection
can take one between the check and the server's bind: 8 gateways and a cluster starting together
once lost that race ("Address already in use"). Cluster nodes take 10000-19999 (their bus twins,
port + 10000, 20000-29999); every other server 30000 up to the ephemeral range. A port is never
handed out twice in a row of 1024 in this process: it may not be bound yet by whoever took it. With
the suite split over workers (`make test`: pytest-xdist), each worker picks from its own part.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections import deque
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_RECENT: deque[int] = deque(maxlen=1024)


def _bindable(*ports: int) -> bool:
    try:
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def _pick(low: int, high: int, twin: int = 0) -> int | None:
    # the last picks of this process, up to half the range: they may not be bound yet
    recent = set(itertools.islice(reversed(_RECENT), (high - low + 1) // 2))
    for _ in range(500):
        port = random.randint(low, high)
        if port not in recent and _bindable(port, *([port + twin] if twin else [])):
            _RECENT.append(port)
            return port
    return None


def _share(low: int, high: int) -> tuple[int, int]:
    """This test process's part of [low, high]: the suite's workers (pytest-xdist's gwN) pick from
    disjoint parts, so two of them never race for one port between the check and the bind."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    if not worker.startswith("gw") or int(workers) < 2:
        return low, high
    index, count = int(worker[2:]), int(workers)
    size = (high - low + 1) // count
    return low + index * size, low + (index + 1) * size - 1


def free_port() -> int:
    low, high = _share(30000, _EPHEMERAL_LOW - 1)
    # (a share of 2,768 ports split three ways is 922: a bar of 1,000 here once sent every pick of
    # `make test`'s three workers to the kernel's range, where outgoing connections take them too)
    port = _pick(low, high) if high - low >= 100 else None
    while port is None:  # no room below the ephemeral range here: the kernel picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            found = int(sock.getsockname()[1])
        if found not in _RECENT:  # (it may hand out the port it handed out last)
            _RECENT.append(found)
            port = found
    return port


def free_cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free too."""
    port = _pick(*_share(10000, 19999), twin=10000)
    if port is None:
        raise RuntimeError("no free port pair for a cluster node")
    return port
