"""`make run`: the example backend and `gateway serve` in front of it, stopped together.

make execs this script as its recipe's only process. SIGTERM, SIGINT or SIGHUP, to this script or
to the process group (a terminal's Ctrl-C), stops the gateway gracefully and then the backend. The
backend and the embedded Redis are in process groups of their own, so a Ctrl-C stops them only after
the gateway has drained. GNU make forwards SIGTERM to its recipe but not SIGINT (it waits for the
recipe, counting on the terminal's process group): a SIGINT sent to make's own pid is seen here
because make, handling it, blocks that signal, and /proc shows make's blocked set. If make dies
outright, the kernel's parent-death signal stops this script, and this script's own children go
with it the same way. If the backend exits (its port taken), the gateway is stopped too and make
fails, saying so.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from gateway.parent_death import die_with_parent, dying_with_this_process

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def make_is_stopping(pid: int) -> bool:
    """Is `pid` a make inside its handler of a fatal signal (the signal is blocked there)?"""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone
    if comm not in ("make", "gmake"):
        return False
    blocked = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigBlk:"))
    return any(blocked & (1 << (sig - 1)) for sig in STOPS)


def gateway_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "gateway", "serve", "--config", args.config, "--host", args.host,
            "--port", str(args.port), "--admin-port", str(args.admin_port), "--data-dir", args.data_dir]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="routes.yaml")
    parser.add_argument("--host", default="127.0.0.1", help="the proxy port's address (this machine only unless given)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--admin-port", type=int, default=9090)
    parser.add_argument("--backend-port", type=int, default=9000)
    parser.add_argument("--data-dir", default=".run-state",
                        help="where the embedded Redis keeps limits and overrides between runs (git-ignored)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent = os.getppid()
    die_with_parent(signal.SIGTERM, parent)
    stop_requested: list[int] = []

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    for sig in STOPS:
        signal.signal(sig, on_stop)
    with_us = dying_with_this_process(signal.SIGTERM)
    # a group of its own: a terminal's Ctrl-C reaches the gateway, which drains what is in flight to
    # the backend; the backend is stopped after it
    backend = subprocess.Popen([sys.executable, "-m", "gateway.example_backend", "--port", str(args.backend_port)],
                               preexec_fn=with_us, process_group=0)
    env = dict(os.environ, SHOP_URL=f"http://127.0.0.1:{args.backend_port}")
    gateway = subprocess.Popen(gateway_command(args), env=env, preexec_fn=with_us)
    try:
        while (gateway.poll() is None and backend.poll() is None and not stop_requested
               and not make_is_stopping(parent)):
            time.sleep(0.2)
        if gateway.poll() is None:
            gateway.send_signal(signal.SIGTERM)  # drains, stops the embedded Redis, exits 0
        code = gateway.wait()
        if backend.poll() is not None and not stop_requested:
            # the gateway would answer every request 502 or 504: say why and stop instead
            print(f"make run: the example backend on port {args.backend_port} exited ({backend.returncode}); "
                  "stopped the gateway too (is the port in use? --backend-port in RUN_ARGS picks another)",
                  file=sys.stderr)
            code = code or 1
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        backend.terminate()
        backend.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
