#!/usr/bin/env python3
"""What one decision costs the worker's Python, with no sockets between: `python bench/inprocess.py`.

The worker's own parts (gateway/http/server.py's protocol, the app from gateway/app.py, redis-py to a
real redis-server) serve 50 connections whose transports are in-process objects: each round, every
connection is fed the check request bench/check.lua sends and the round ends when all 50 are
answered, so their decisions share Redis batches as at 50 connections under wrk. What the kernel
and wrk cost is out of it; what is left is the Python a decision runs, which is what the floor's
multiple is made of.

    check     the check port, bench/run.py's 3-rule route (as bench/check.py asks it)
    rls       the RLS port, bench/rls.py's domain (3 descriptors, the same 3 rules), 50 calls a round
              on one HTTP/2 connection, as bench/rls.py's h2load asks it (frames built beforehand)
    proxy     the proxy port, the same route, forwarding to nginx (bench/run.py's upstream)
    server    the same server and door with a door that answers at once (the server's own share)
    engine    Limiter.decide on keys read once (the engine alone, 50 calls gathered per round)

`--callers N`: the requests (check, proxy) and calls (rls) come from N users in turn (1, as wrk
and h2load ask; 0: each from a new one), so what the gateway remembers per caller is measured
with as many callers as it keeps (2,048) and more.

`--connections 1`: one request a round, so every decision is a batch of its own (a lone decision's
cost, bench/run.py's one-connection rows without the kernel's part).

CPU time moves with the VM from run to run: each run reports the minimum and median over segments
of 100 rounds. `--callgrind` counts instructions instead (valgrind, two runs of different lengths,
their difference per request), which do not move: compare revisions with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import rls  # noqa: E402  (bench/rls.py: the RLS domain and its message)
import run  # noqa: E402  (bench/run.py: processes, redis-server, the 3-rule route)

CONNECTIONS = 50
CHECK_PORT, PROXY_PORT = 8081, 8080
REQUEST = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8081\r\nX-User-Id: bench-user\r\nX-Forwarded-Method: GET\r\n"
           b"X-Forwarded-Uri: /api/items/42\r\nX-Forwarded-Host: bench\r\n\r\n")
FORWARDED = b"GET /api/items/42 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nX-User-Id: bench-user\r\n\r\n"
KINDS = ("server", "engine", "check", "rls", "proxy")
RLS_PORT = 8082
CALLERS = 1  # rls: the callers its calls come from in turn (0: every call from a new one)


class _Served:
    """uvicorn's server state, as the protocol uses it; `done` resolves when `target` answers are in."""

    def __init__(self) -> None:
        self.connections: set[Any] = set()
        self.tasks: set[Any] = set()
        self.answered = 0
        self.target = 0
        self.done: asyncio.Future[None] | None = None

    @property
    def total_requests(self) -> int:
        return self.answered

    @total_requests.setter
    def total_requests(self, value: int) -> None:
        self.answered = value
        if value >= self.target and self.done is not None and not self.done.done():
            self.done.set_result(None)


class _Transport:
    """A client connection in memory: what is written is kept (the last answer), nothing is sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.last = b""
        self.closing = False

    def write(self, data: bytes) -> None:
        self.last = data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", self.port), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...


def _segments(total_rounds: int) -> int:
    return max(1, total_rounds // 100)


async def _serve(what: str, redis_url: str, config: Path, rounds: int, warmup: int) -> list[float]:
    from gateway.app import compose
    from gateway.config.loader import load_config
    from gateway.http.server import HttpProtocol
    from gateway.settings import Settings
    from gateway.supervisor import server_config

    settings = Settings(port=PROXY_PORT, check_port=CHECK_PORT, rls_port=RLS_PORT, admin_port=9099,
                        redis_url=redis_url, config_path=str(config), log_level="warning")
    composed = compose(settings, load_config(config))
    served = server_config(settings, composed)
    served.load()
    if what == "server":
        async def at_once(scope: Any, receive: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
            return 200, [(b"content-length", b"0")], b""

        options = served.options  # type: ignore[attr-defined]
        served.options = type(options)(**{**options.__dict__, "doors": {CHECK_PORT: at_once}})  # type: ignore[attr-defined]
    state = _Served()
    async with composed.lifecycle.lifespan(None):
        if what == "engine":
            return await _engine(composed, rounds, warmup)
        if what == "rls":
            return await _rls(composed, rounds, warmup)
        port, request = (PROXY_PORT, FORWARDED) if what == "proxy" else (CHECK_PORT, REQUEST)
        transports = [_Transport(port) for _ in range(CONNECTIONS)]
        protocols = []
        for transport in transports:
            protocol = HttpProtocol(served, state, {})
            protocol.connection_made(transport)  # type: ignore[arg-type]
            protocols.append(protocol)

        sent = iter(_http_rounds(request, warmup + _segments(rounds) * 100))

        async def one_round() -> None:
            state.target = state.answered + CONNECTIONS
            state.done = asyncio.get_running_loop().create_future()
            for protocol, data in zip(protocols, next(sent), strict=True):
                protocol.data_received(data)
            await state.done

        for _ in range(warmup):
            await one_round()
        answer = transports[0].last
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the request was not admitted: {answer[:300]!r}")
        return await _timed(one_round, rounds)


def _http_rounds(request: bytes, count: int) -> list[list[bytes]]:
    """`count` rounds of the request, one a connection: from CALLERS users in turn (X-User-Id), or
    (CALLERS 0) each from a new one. Built beforehand, so the harness costs the same either way."""
    if CALLERS == 1:
        return [[request] * CONNECTIONS] * count
    users = CALLERS or count * CONNECTIONS
    made = [request.replace(b"X-User-Id: bench-user", b"X-User-Id: bench-user-%d" % i)
            for i in range(min(users, count * CONNECTIONS))]
    return [[made[(r * CONNECTIONS + c) % users] for c in range(CONNECTIONS)] for r in range(count)]


async def _engine(composed: Any, rounds: int, warmup: int) -> list[float]:
    from gateway.check import Asked
    from gateway.http.request import read_request
    from gateway.identity import RequestView
    from gateway.pipeline import identify

    runtime = composed.lifecycle.current()
    plan = runtime.plans["bench"]
    headers = [(b"host", b"127.0.0.1:8081"), (b"x-user-id", b"bench-user"), (b"x-forwarded-method", b"GET"),
               (b"x-forwarded-uri", b"/api/items/42"), (b"x-forwarded-host", b"bench")]
    scope = {"type": "http", "http_version": "1.1", "server": ("127.0.0.1", CHECK_PORT), "client": ("127.0.0.1", 1),
             "scheme": "http", "method": "GET", "path": "/", "raw_path": b"/", "query_string": b"", "headers": headers}
    request = read_request(scope, original=Asked())
    _, keys, costs, specs, _, _ = identify(plan, RequestView(request, {}, runtime.config, runtime.jwt))

    async def one_round() -> None:
        await asyncio.gather(*[runtime.limiter.decide(specs, keys, costs) for _ in range(CONNECTIONS)])

    for _ in range(warmup):
        await one_round()
    return await _timed(one_round, rounds)


def _rls_rounds(count: int) -> list[bytes]:
    """What an HTTP/2 client sends: the preface (its windows as large as HTTP/2 allows, so it never
    needs to read an answer), then per round 50 unary calls of bench/rls.py's message, each a
    HEADERS and a DATA frame (hyperframe and hpack, h2's own parts)."""
    from hpack import Encoder
    from hyperframe.frame import DataFrame, HeadersFrame, SettingsFrame, WindowUpdateFrame

    from gateway.rls import messages as pb

    def body(caller: int) -> bytes:
        message = pb.RateLimitRequest(domain="bench")
        for key, value in (("user", f"bench-user-{caller}"), ("remote_address", "127.0.0.1"), ("global", "all")):
            message.descriptors.add().entries.add(key=key, value=value)
        return rls.grpc_body(message.SerializeToString())

    bodies = [body(i) for i in range(CALLERS)] if CALLERS else []
    sent = 0
    encoder = Encoder()
    head = [(":method", "POST"), (":scheme", "http"), (":path", rls.RLS_PATH), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers")]
    settings = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1})
    out = [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings.serialize() + SettingsFrame(0, flags=["ACK"]).serialize()
           + WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535).serialize()]
    stream = 1
    for _ in range(count):
        frames = []
        for _ in range(CONNECTIONS):
            headers = HeadersFrame(stream, data=encoder.encode(head), flags=["END_HEADERS"])
            message = bodies[sent % CALLERS] if CALLERS else body(sent)  # --callers 0: each call a new caller
            frames += [headers.serialize(), DataFrame(stream, data=message, flags=["END_STREAM"]).serialize()]
            stream += 2
            sent += 1
        out.append(b"".join(frames))
    return out


async def _rls(composed: Any, rounds: int, warmup: int) -> list[float]:
    from gateway.rls.server import GrpcProtocol

    # as many frames built for 100 rounds as for 300: --callgrind's two runs differ by the rounds alone
    sent = iter(_rls_rounds(warmup + max(_segments(rounds) * 100, 300)))
    served = composed.rls_server
    protocol = GrpcProtocol(served.calls, served.now, set(), 60.0, served.engine)
    transport = _Transport(RLS_PORT)
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(next(sent))  # the preface
    loop = asyncio.get_running_loop()
    done: list[asyncio.Future[None]] = []
    written = transport.write

    def write(data: bytes) -> None:
        written(data)
        if done and not protocol.tasks and not done[0].done():
            done[0].set_result(None)

    transport.write = write  # type: ignore[method-assign]

    async def one_round() -> None:
        target = protocol.answered + CONNECTIONS
        done[:] = [loop.create_future()]
        protocol.data_received(next(sent))
        if protocol.tasks:  # resolved by the write that follows the round's last answer
            await done[0]
        if protocol.answered != target:  # an error status is written, not answered
            raise RuntimeError(f"{target - protocol.answered} calls were not answered OK: {transport.last[-300:]!r}")

    for _ in range(warmup):
        await one_round()
    answer = _last_answer(transport.last)
    if not answer.statuses or not all(status.current_limit.requests_per_unit for status in answer.statuses):
        raise RuntimeError(f"the calls were not decided by the domain's rules: {answer}")
    return await _timed(one_round, rounds)


def _last_answer(written: bytes) -> Any:
    """The last RateLimitResponse in what the server wrote (its last DATA frame's gRPC message)."""
    from hyperframe.frame import DataFrame, Frame

    from gateway.rls import messages as pb

    message, at = b"", 0
    while at + 9 <= len(written):
        frame, length = Frame.parse_frame_header(memoryview(written[at:at + 9]))
        frame.parse_body(memoryview(written[at + 9:at + 9 + length]))
        if isinstance(frame, DataFrame) and frame.data:
            message = frame.data[5:]
        at += 9 + length
    return pb.RateLimitResponse.FromString(message)


async def _timed(one_round: Any, rounds: int) -> list[float]:
    """µs of this process's CPU per request, per segment of 100 rounds."""
    segments = []
    for _ in range(_segments(rounds)):
        started = time.process_time()
        for _ in range(100):
            await one_round()
        segments.append((time.process_time() - started) / (100 * CONNECTIONS) * 1e6)
    return sorted(segments)


def _callgrind(what: str, redis_url: str, config: Path, tmp: Path) -> float:
    """Instructions per request: two runs under callgrind, 100 and 300 rounds, their difference."""
    counts = []
    for rounds in (100, 300):
        out = tmp / f"callgrind.{what}.{rounds}"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                        what, "--rounds", str(rounds), "--warmup", "20", "--redis-url", redis_url,
                        "--config", str(config), "--connections", str(CONNECTIONS), "--callers", str(CALLERS)],
                       check=True, capture_output=True)
        summary = next(line for line in out.read_text(errors="replace").splitlines()
                       if line.startswith(("summary:", "totals:")))
        counts.append(int(summary.split()[1]))
    return (counts[1] - counts[0]) / (200 * CONNECTIONS)


def main(argv: list[str] | None = None) -> int:
    global CONNECTIONS, CALLERS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help="server, engine, check, proxy (default: all)")
    parser.add_argument("--rounds", type=int, default=2000, help="rounds of 50 requests measured (2000)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="requests a round (50)")
    parser.add_argument("--callers", type=int, default=CALLERS,
                        help="check, proxy, rls: users the requests come from in turn (1; 0: each from a new one)")
    parser.add_argument("--callgrind", action="store_true", help="count instructions (valgrind) instead of CPU time")
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)  # a run under callgrind: the parent's Redis
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    CONNECTIONS, CALLERS = args.connections, args.callers
    args.what = args.what or list(KINDS)
    unknown = set(args.what) - set(KINDS)
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    import uvloop

    if args.redis_url:  # one measurement, for the parent
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        for what in args.what:
            asyncio.run(_serve(what, args.redis_url, args.config, args.rounds, args.warmup))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-inprocess-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "logs").mkdir()
        procs = run.Processes(tmp / "logs")
        try:
            port, upstream = run.free_port(), run.free_port()
            run.start_redis(procs, tmp / "redis", port)
            run.start_nginx(procs, "upstream", tmp / "upstream", upstream, 1, run.upstream_server(upstream))
            redis_url = f"redis://127.0.0.1:{port}"
            config = tmp / "routes.yaml"
            # the bench's 3-rule route; budgets valgrind's slowness cannot miss
            config.write_text(run.GATEWAY_CONFIG.format(upstream_port=upstream).replace("timeout: 50ms", "timeout: 5s")
                              .replace("timeout: 10s", "timeout: 60s") + rls.RLS_DOMAIN)
            for what in args.what:
                if args.callgrind:
                    print(f"{what}: {_callgrind(what, redis_url, config, tmp):,.0f} instructions per request")
                    continue
                asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
                found = asyncio.run(_serve(what, redis_url, config, args.rounds, args.warmup))
                print(f"{what}: {found[0]:.1f} µs of CPU per request at least, {found[len(found) // 2]:.1f} "
                      f"the median of {len(found)} segments of {100 * CONNECTIONS} requests")
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GATEWAY_LOG_LEVEL", "warning")
    sys.exit(main())
