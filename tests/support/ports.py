"""Free TCP ports on the loopback interface."""

from __future__ import annotations

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
_RECENT: deque[int] = deque(maxlen=1024)  # handed out lately: perhaps not bound yet by whoever took it


def free_port() -> int:
    """A free port for a server a test starts. Taken from below the kernel's ephemeral range
    (30000 up to it; cluster nodes use 10000-29999), where no outgoing connection can take it
    between this check and the server's bind: 8 gateways and a cluster starting together once lost
    that race ("Address already in use"). Not one handed out lately in this process."""
    if _EPHEMERAL_LOW - 30000 >= 2048:
        for _ in range(200):
            port = random.randint(30000, _EPHEMERAL_LOW - 1)
            if port in _RECENT or port in _CHOSEN:
                continue
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _RECENT.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room below: the kernel picks
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _RECENT.append(port)
    return port


_CHOSEN: set[int] = set()


def free_cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free too, both below the kernel's
    ephemeral range (32768 and up), where an outgoing connection could take one between this check
    and the node's start; never one handed out before in this process."""
    for _ in range(500):
        port = random.randint(10000, 19999)
        if port in _CHOSEN:
            continue
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        _CHOSEN.add(port)
        return port
    raise RuntimeError("no free port pair for a cluster node")
