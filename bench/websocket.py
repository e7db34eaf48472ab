#!/usr/bin/env python3
"""Issue 21's tunnel benchmark: WebSocket throughput through the gateway (1 worker) against the
same upstream reached directly, with the same client.

    python bench/websocket.py                 # 200 MiB per measurement
    python bench/websocket.py --mib 50        # a quick look

The upstream is tests/support/ws_upstream.py (the `websockets` package: /source/N, /sink, /echo);
the client is the `websockets` asyncio client, 1 MiB binary messages, no compression. Measured,
each direct and through the gateway, best of 3: down (the upstream sends), up (the client sends)
and both (an echo: as much each way at once). The route has one fixed_window rule (the handshake is
decided like any request). Prints MB/s (10^6 bytes) and the gateway's share of the direct rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from run import ROOT, Processes, free_port, http_get, start_redis, wait_for
from websockets.asyncio.client import connect

MiB = 1 << 20
CONFIG = """
version: 1
upstreams:
  ws: {{url: "http://127.0.0.1:{port}"}}
routes:
  - name: tunnel
    match: {{path: "/{{rest:path}}"}}
    upstream: ws
    websocket: true
    limits:
      - {{name: ip, by: [ip], algorithm: fixed_window, limit: 1000000, window: 1h}}
"""


async def down(base: str, mib: int) -> float:
    started = time.perf_counter()
    got = 0
    async with connect(f"{base}/source/{mib}", max_size=None, compression=None) as ws:
        async for message in ws:
            got += len(message)
    assert got == mib * MiB, got
    return time.perf_counter() - started


async def up(base: str, mib: int) -> float:
    piece = os.urandom(MiB)
    started = time.perf_counter()
    async with connect(f"{base}/sink", max_size=None, compression=None) as ws:
        for _ in range(mib):
            await ws.send(piece)
        await ws.send("end")
        assert int(await ws.recv()) == mib * MiB
    return time.perf_counter() - started


async def both(base: str, mib: int) -> float:
    piece = os.urandom(MiB)
    started = time.perf_counter()
    async with connect(f"{base}/echo", max_size=None, compression=None) as ws:
        async def send() -> None:
            for _ in range(mib):
                await ws.send(piece)

        async def receive() -> None:
            got = 0
            while got < mib * MiB:
                got += len(await ws.recv())

        await asyncio.gather(send(), receive())
    return time.perf_counter() - started


def best(run: Callable[[str, int], Coroutine[Any, Any, float]], base: str, mib: int) -> float:
    return mib * MiB / 1e6 / min(asyncio.run(run(base, mib)) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=200, help="MiB per measurement (default 200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        procs = Processes(tmp)
        try:
            env = dict(os.environ, PYTHONPATH=str(ROOT), GATEWAY_LOG_LEVEL="warning", GATEWAY_DRAIN_TIMEOUT="2")
            upstream_port, redis_port, port, admin_port = free_port(), free_port(), free_port(), free_port()
            upstream = procs.start("upstream", [sys.executable, "-m", "tests.support.ws_upstream", "--port",
                                                str(upstream_port)], env=env, cwd=ROOT)
            wait_for(lambda: http_get(f"http://127.0.0.1:{upstream_port}/handshakes")[0] == 200, "listening",
                     upstream, procs, "upstream")
            start_redis(procs, tmp, redis_port)
            config = tmp / "routes.yaml"
            config.write_text(CONFIG.format(port=upstream_port))
            gateway = procs.start("gateway", [
                sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), "--admin-port", str(admin_port), "--workers", "1",
                "--redis-url", f"redis://127.0.0.1:{redis_port}"], env=env, cwd=tmp)
            wait_for(lambda: http_get(f"http://127.0.0.1:{admin_port}/readyz")[0] == 200, "/readyz 200",
                     gateway, procs, "gateway")
            rows = []
            for name, run in (("down", down), ("up", up), ("both (each way)", both)):
                direct = best(run, f"ws://127.0.0.1:{upstream_port}", args.mib)
                through = best(run, f"ws://127.0.0.1:{port}", args.mib)
                rows.append((name, direct, through))
        finally:
            procs.stop_all()
    print(f"WebSocket tunnel, {args.mib} MiB per run, 1 MiB messages, best of 3 (MB/s)\n")
    print("| direction | direct | through the gateway | share |")
    print("| --- | --- | --- | --- |")
    for name, direct, through in rows:
        print(f"| {name} | {direct:.0f} | {through:.0f} | {through / direct:.0%} |")


if __name__ == "__main__":
    main()
