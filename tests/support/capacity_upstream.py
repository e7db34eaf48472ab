"""A real upstream with a fixed capacity (run as a subprocess): it serves `--capacity` requests at once,
each for `--service` seconds, and queues the rest in arrival order, so its answer time grows with its
load as a backend's does when its workers are all busy.

    GET  /work           200 after waiting its turn and being served
    GET  /stats          JSON: served (answers given), in_system (queued + served now), most_in_system
    POST /stats/reset    zero the counters
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

from aiohttp import web

from tests.support.orphans import started
from tests.support.upstream import Upstream
from tests.support.waiting import wait_for_port

STATS = {"served": 0, "in_system": 0, "most_in_system": 0}


def make_app(capacity: int, service: float) -> web.Application:
    workers = asyncio.Semaphore(capacity)  # FIFO: waiters are woken in arrival order

    async def work(request: web.Request) -> web.Response:
        STATS["in_system"] += 1
        STATS["most_in_system"] = max(STATS["most_in_system"], STATS["in_system"])
        try:
            async with workers:
                await asyncio.sleep(service)
                STATS["served"] += 1
        finally:
            STATS["in_system"] -= 1
        return web.json_response({"served": True})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(STATS)

    async def reset(request: web.Request) -> web.Response:
        STATS.update(served=0, most_in_system=STATS["in_system"])
        return web.json_response(STATS)

    app = web.Application()
    app.router.add_get("/work", work)
    app.router.add_get("/stats", stats)
    app.router.add_post("/stats/reset", reset)
    return app


class CapacityUpstream(Upstream):
    module = "tests.support.capacity_upstream"

    def __init__(self, capacity: int, service: float) -> None:
        super().__init__()
        self.capacity = capacity
        self.service = service

    def start(self) -> None:
        self.process = started([sys.executable, "-m", self.module, "--port", str(self.port), "--capacity",
                                str(self.capacity), "--service", str(self.service)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.process)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--service", type=float, required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.capacity, args.service), host="127.0.0.1", port=args.port, print=None,
                access_log=None, shutdown_timeout=0.1)  # stopped at once: nobody waits for its answers then


if __name__ == "__main__":
    main()
