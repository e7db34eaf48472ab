"""Waiting for real processes to be ready, with a bound (scaled by the suite's time factor)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

from tests.support.patience import within


def wait_for_port(port: int, process: subprocess.Popen[bytes] | None = None, timeout: float = 20.0) -> None:
    timeout = within(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port} after {timeout}s")


def wait_until(check: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> None:
    timeout = within(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"condition not met in {timeout:.1f}s")
