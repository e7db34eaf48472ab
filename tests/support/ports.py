"""Free TCP ports on the loopback interface."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_CHOSEN: set[int] = set()


def free_cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free too, both below the kernel's
    ephemeral range (32768 and up), where an outgoing connection could take one between this check
    and the node's start; never one handed out before in this process."""
    import random

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
