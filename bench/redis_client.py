"""Client CPU per decision on the Redis side of the gateway: redis-py one EVALSHA per decision vs
the gateway's runner (the decisions of one event-loop tick in one write on its connection), the
runner as it was (a redis-py pipeline per batch), and the whole Limiter.decide on top of it; a
lone decision (1 in flight) and decisions under load (50 in flight).

    .venv/bin/python bench/redis_client.py                      # uvloop, 20,000 decisions, 5 rounds
    .venv/bin/python bench/redis_client.py --in-flight 1 --modes pipeline,batched
    .venv/bin/python bench/redis_client.py --loop asyncio --decisions 50000
    .venv/bin/python bench/redis_client.py --cluster            # a 3-primary Redis Cluster instead
    .venv/bin/python bench/redis_client.py --seam               # the installed redis-py's ways to call
    .venv/bin/python bench/redis_client.py --instructions --modes batched,limiter   # counts, callgrind

Each mode runs `--decisions` 3-rule decisions (bench/engine.py's route: token_bucket per user,
sliding_window and quota per item) with `--in-flight` of them in flight all the time, against a
real local redis-server (or Cluster) pinned to one core (this process on the other); the figure is this
process's CPU time (time.process_time) per decision: the median and the least of the rounds (the
host is shared: the least is the one least disturbed). Redis's own CPU is
not in it (bench/engine.py measures that).

    unbatched  redis.asyncio.Redis (RedisCluster) with its defaults, one `await evalsha()` per decision
    pipeline   the runner before (one server only): the calls of a tick in one redis-py pipeline on
               a pooled connection, up to 16 batches in flight
    batched    gateway.redis's runner: the calls of a tick in one packed write on its one connection
               (one per node), read back in order
    limiter    gateway.limiter.Limiter.decide on that runner: the whole decision path

The host is shared: for the old path against the new one, alternate runs of the two modes
(`--modes pipeline,batched --repeat 3`) and compare the pairs.

--seam: CPU per lone EVALSHA of `return 1` (5,000 in turn, uvloop) through the installed redis-py's
client API, its `Connection` (send_packed_command + read_response) with and without a socket
timeout, and its parser alone; to choose a version, run it in a venv of each, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import ROUTE, route_keys  # bench/engine.py: the same 3-rule route and keys
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from gateway.config import RedisSettings
from gateway.decision_script import decision_script
from gateway.limiter import Limiter, rule_spec
from gateway.redis import PipelineRunner, make_runner
from tests.support.cluster import RedisCluster
from tests.support.redis_proc import RedisProcess

T = TypeVar("T")

USERS = 5000


class PooledPipelineRunner(PipelineRunner):
    """The one-server runner as it was before it kept one connection: each batch a redis-py
    pipeline (transaction=False) on a connection from the pool, up to 16 batches in flight."""

    max_batches = 16

    async def _pipeline(self, commands: Sequence[tuple[bytes | str | int, ...]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.pipeline_execute_command(*command)  # type: ignore[no-untyped-call]
        return await pipe.execute(raise_on_error=False)


async def drive(call: Callable[[int], Awaitable[Any]], count: int, in_flight: int) -> None:
    """`count` calls, `in_flight` of them waiting at any time."""
    numbers = iter(range(count))

    async def worker() -> None:
        for i in numbers:
            await call(i)

    await asyncio.gather(*[worker() for _ in range(in_flight)])


async def measure(url: str, cluster: bool, mode: str, count: int, in_flight: int, rounds: int,
                  warmup: int = 5000) -> list[float]:
    specs = [rule_spec(r) for r in ROUTE]
    script = decision_script(tuple(specs)).script
    keys = [route_keys(i, USERS) for i in range(count)]
    costs = [1, 1, 1]
    settings = RedisSettings(url=url, timeout=5.0, mode="cluster" if cluster else "standalone")
    close: Callable[[], Awaitable[None]]
    call: Callable[[int], Awaitable[Any]]
    if mode == "unbatched":
        client: Any = ClusterClient.from_url(url) if cluster else Redis.from_url(url)
        await client.script_load(script.source)
        sha = script.sha.decode()

        def call(i: int) -> Awaitable[Any]:
            return cast(Awaitable[Any], client.evalsha(sha, 3, *keys[i], *costs))

        close = client.aclose
    elif mode in ("batched", "pipeline"):
        runner = make_runner(settings)
        if mode == "pipeline":
            assert isinstance(runner, PipelineRunner), "pipeline: one server only"
            runner = PooledPipelineRunner(runner.client, runner.timeout)

        def call(i: int) -> Awaitable[Any]:
            return runner.run(script, keys[i], costs)

        close = runner.close
    else:
        limiter = Limiter(make_runner(settings))

        def call(i: int) -> Awaitable[Any]:
            return limiter.decide(specs, keys[i], costs)

        close = limiter.close
    await drive(call, min(count, warmup), in_flight)  # connect, load the script, warm up
    out = []
    for _ in range(rounds):
        started = time.process_time()
        await drive(call, count, in_flight)
        out.append((time.process_time() - started) / count * 1e6)
    await close()
    return out


async def seam(url: str, count: int) -> dict[str, float]:
    import hiredis
    from redis.asyncio.connection import Connection

    client = Redis.from_url(url)
    sha = await client.script_load("return 1")
    packed = hiredis.pack_command(cast(Any, (b"EVALSHA", sha.encode(), 0)))
    port = int(url.rsplit(":", 1)[1])
    # Any: redis-py leaves connect() and the stream writer and parser unannotated
    timed: Any = Connection(port=port, socket_timeout=5.0)
    bare: Any = Connection(port=port, socket_timeout=None)
    await timed.connect()
    await bare.connect()

    async def api() -> None:
        await client.evalsha(sha, 0)

    async def connection_timed() -> None:
        await timed.send_packed_command(packed, check_health=False)
        await timed.read_response()

    async def connection() -> None:
        await bare.send_packed_command(packed, check_health=False)
        await bare.read_response()

    async def parser() -> None:
        bare._writer.write(packed)
        await bare._parser.read_response()

    out: dict[str, float] = {}
    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "client API": api, "Connection, socket_timeout 5 s": connection_timed,
        "Connection, socket_timeout None": connection, "its parser alone": parser}
    for name, way in ways.items():
        for _ in range(500):
            await way()
        started = time.process_time()
        for _ in range(count):
            await way()
        out[name] = (time.process_time() - started) / count * 1e6
    await client.aclose()
    await timed.disconnect()
    await bare.disconnect()
    return out


async def round_trips(url: str, seconds: float) -> dict[str, float]:
    """Lone EVALSHA calls of `return 1`, one after another, for `seconds`, through redis-py's
    `Connection` as the runner drives it: the floor under a lone decision (no script work, no
    Python of ours), in wall time per call (p50, p99) and this process's CPU per call."""
    import hiredis
    from redis.asyncio.connection import Connection, UnixDomainSocketConnection

    client = Redis.from_url(url)
    sha = await client.script_load("return 1")
    await client.aclose()
    packed = hiredis.pack_command(cast(Any, (b"EVALSHA", sha.encode(), 0)))
    connection: Any = (UnixDomainSocketConnection(path=url.removeprefix("unix://"), socket_timeout=None)
                       if url.startswith("unix://") else
                       Connection(port=int(url.rsplit(":", 1)[1]), socket_timeout=None))
    await connection.connect()
    for _ in range(500):
        await connection.send_packed_command(packed, check_health=False)
        await connection.read_response()
    times: list[float] = []
    clock = time.perf_counter
    cpu, end = time.process_time(), clock() + seconds
    while (started := clock()) < end:
        await connection.send_packed_command(packed, check_health=False)
        await connection.read_response()
        times.append(clock() - started)
    cpu = time.process_time() - cpu
    await connection.disconnect()
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1000, "p99_ms": times[int(len(times) * 0.99)] * 1000,
            "cpu_us_per_request": cpu / len(times) * 1e6, "rps": len(times) / seconds}


def run_loop(coro: Coroutine[Any, Any, T], loop: str) -> T:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def instructions(url: str, modes: list[str], in_flights: list[int], small: int, loop: str) -> None:
    """Client instructions per decision (user space, callgrind): this script run again under
    valgrind with `small` and 6 x `small` decisions, the difference divided by the difference.
    Counts, not seconds: the same on a quiet or a busy machine, where the lone call's time is
    mostly the VM waking a process on the other core."""
    import subprocess
    import tempfile

    print(f"| client instructions per decision (one server, {loop}, callgrind) | in flight | instructions |")
    print("| --- | ---: | ---: |")
    for in_flight in in_flights:
        for mode in modes:
            totals = []
            for count in (small, 6 * small):
                with tempfile.NamedTemporaryFile(suffix=".callgrind") as out:
                    done = subprocess.run(
                        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}",
                         sys.executable, __file__, "--url", url, "--modes", mode, "--in-flight", str(in_flight),
                         "--decisions", str(count), "--rounds", "1", "--warmup", "300", "--loop", loop],
                        capture_output=True, text=True, check=True)
                found = re.search(r"Collected : (\d+)", done.stderr)
                assert found, done.stderr[-2000:]
                totals.append(int(found.group(1)))
            print(f"| {mode} | {in_flight} | {(totals[1] - totals[0]) / (5 * small):,.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--in-flight", default="1,50", help="decisions in flight, one run each: 1,50")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--modes", default="unbatched,pipeline,batched,limiter")
    parser.add_argument("--repeat", type=int, default=1, help="run the list of modes this many times, in turn")
    parser.add_argument("--cluster", action="store_true", help="a Redis Cluster of three primaries")
    parser.add_argument("--seam", action="store_true", help="lone calls through redis-py's API, Connection, parser")
    parser.add_argument("--instructions", action="store_true",
                        help="client instructions per decision under callgrind instead of CPU time (slow)")
    parser.add_argument("--warmup", type=int, default=5000, help=argparse.SUPPRESS)
    parser.add_argument("--url", help="a server already running, instead of one of this script's own")
    parser.add_argument("--round-trips", type=float, metavar="SECONDS",
                        help="lone EVALSHA of `return 1` on --url for SECONDS: p50, p99, CPU per call (JSON)")
    args = parser.parse_args()
    if args.round_trips:
        import json

        print(json.dumps(run_loop(round_trips(args.url, args.round_trips), "uvloop")))
        return
    modes = [m for m in args.modes.split(",") if not (args.cluster and m == "pipeline")]
    in_flights = [int(n) for n in args.in_flight.split(",")]
    if args.url:
        for in_flight in in_flights:
            for mode in modes:
                coro = measure(args.url, args.cluster, mode, args.decisions, in_flight, args.rounds, args.warmup)
                print(run_loop(coro, args.loop))
        return
    servers = RedisCluster() if args.cluster else RedisProcess()
    servers.start()
    processes = servers.nodes if isinstance(servers, RedisCluster) else [servers]
    url = servers.url
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        for proc in processes:
            if proc.process is not None:
                os.sched_setaffinity(proc.process.pid, {cores[-1]})
        os.sched_setaffinity(0, set(cores[:-1]))
    try:
        if args.seam:
            import redis
            import uvloop

            found = uvloop.run(seam(url, 5000))
            print(f"| redis-py {redis.__version__}, CPU per lone EVALSHA, µs | "
                  + " | ".join(f"{k}: {v:.1f}" for k, v in found.items()) + " |")
            return
        if args.instructions:
            instructions(url, modes, in_flights, min(args.decisions, 500), args.loop)
            return
        where = "Cluster" if args.cluster else "one server"
        print(f"| client CPU per decision ({where}, {args.loop}), µs | in flight | median | least | rounds |")
        print("| --- | ---: | ---: | ---: | --- |")
        for in_flight in in_flights:
            for _ in range(args.repeat):
                for mode in modes:
                    results = run_loop(measure(url, args.cluster, mode, args.decisions, in_flight, args.rounds),
                                       args.loop)
                    rounds = " ".join(f"{r:.1f}" for r in results)
                    print(f"| {mode} | {in_flight} | {statistics.median(results):.1f} | {min(results):.1f} "
                          f"| {rounds} |", flush=True)
    finally:
        servers.stop()


if __name__ == "__main__":
    main()
