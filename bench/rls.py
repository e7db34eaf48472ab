#!/usr/bin/env python3
"""Envoy's rate limit service (SPEC section 7) side by side, in one run: `python bench/rls.py`
(`make bench` runs it after bench/check.py).

1. The gRPC library, by measurement: a bare unary echo (a 48-byte message back) on the gateway's
   server (gateway/rls/server.py) on libnghttp2 (ngh2) and on h2, grpclib's Server and grpcio's
   asyncio server; server CPU per call at 1 and 50 concurrent calls.
2. Decisions: the RLS port (3 descriptors, the 3 rules of bench/run.py's route, in the native form)
   on the gateway's server and on grpclib's (tests/support/rls_comparison.py), beside the check port
   deciding the same 3 rules (bench/check.lua): decisions per second and the worker's CPU per
   decision, at 1 and 50 concurrent calls. The bar: RLS decisions per core at least 0.5 of the
   check endpoint's.
3. Through Envoy at 50 connections: Envoy + the gateway's RLS, Envoy's own `local_ratelimit`, and
   the gateway's proxy port alone; requests/s and p50.

gRPC load is h2load (nghttp2): 1 connection x 1 stream, and 2 connections x 25 streams (Envoy
multiplexes its calls on few connections). HTTP load is wrk, as in bench/run.py. Every limit is far
above the load: all measure the admit path (the gateway's gateway_rls_calls_total is checked).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import check  # noqa: E402  (bench/check.py: the check port's wrk run)
import run  # noqa: E402  (bench/run.py: processes, nginx, wrk, CPU readings)

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/rls.py: begin -->", "<!-- bench/rls.py: end -->"
ECHO_PATH = "/bench.Echo/Call"
RLS_PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
TARGET_DECISIONS_PER_CORE = 0.5  # RLS decisions per core / the check port's
CONCURRENCY = {"1": (1, 1), "50": (2, 25)}  # concurrent calls: (connections, streams each)

RLS_DOMAIN = """\
rls:
  domains:
    bench:
      descriptors:
        - key: user
          limit: {name: user, algorithm: token_bucket, rate: 1000000/s, burst: 1000000}
        - key: remote_address
          limit: {name: ip, algorithm: sliding_window, limit: 1000000000, window: 1s}
        - key: global
          limit: {name: global, algorithm: gcra, rate: 1000000/s, burst: 1000000}
    site:                    # the atomicity case: a per-user 3/min beside a per-site 5/min
      descriptors:
        - key: user
          limit: {name: user, algorithm: fixed_window, limit: 3, window: 1m}
        - key: site
          limit: {name: site, algorithm: fixed_window, limit: 5, window: 1m}
"""


# --- 1. bare echo servers ---------------------------------------------------------------------------

ECHO_SERVER = '''
import asyncio, sys
import uvloop

async def echo(message):
    return message

OK = b""

async def ok(message):  # a RateLimitResponse saying OK, whatever was asked: an RLS that costs nothing
    return OK

async def main(kind, port):
    if kind in ("lean", "h2", "ok-rls"):
        import socket
        from gateway.rls.http2 import H2Engine, Ngh2Engine
        from gateway.rls.server import GrpcServer
        if kind == "ok-rls":
            global OK
            from gateway.rls import messages as pb
            OK = pb.RateLimitResponse(overall_code=pb.OK).SerializeToString()
            server = GrpcServer({b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit": ok}, {})
        else:
            server = GrpcServer({b"/bench.Echo/Call": echo}, {}, engine=Ngh2Engine if kind == "lean" else H2Engine)
        sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port)); sock.listen(1024)
        await server.start(sock)
    elif kind == "grpclib":
        from grpclib.server import Server
        from tests.support.rls_comparison import RawCodec, _Service
        server = Server([_Service({b"/bench.Echo/Call": echo}, {})], codec=RawCodec())
        await server.start("127.0.0.1", port)
    else:
        import grpc
        async def handler(request, context):
            return request
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handler)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    await asyncio.Event().wait()

uvloop.install()
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
'''
ECHO_SERVERS = {
    "lean": "gateway's server (gateway/rls/server.py on libnghttp2, ngh2)",
    "h2": "gateway's server on h2 (the comparison)",
    "grpclib": "grpclib Server",
    "grpcio": "grpcio asyncio server (grpc.aio)",
}


def grpc_body(message: bytes) -> bytes:
    return b"\0" + len(message).to_bytes(4, "big") + message


def h2load(url: str, body: Path, connections: int, streams: int, duration: float) -> dict[str, Any]:
    args = ["h2load", "-c", str(connections), "-m", str(streams), "-t", "1", "-D", str(max(1, round(duration))),
            "--warm-up-time", "1", "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
            url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60, check=True)
    text = done.stdout
    rate = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", text)
    finished = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", text)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", text)
    if rate is None or finished is None or mean is None:
        raise RuntimeError(f"h2load said:\n{text}\n{done.stderr}")
    return {"rps": round(float(rate.group(1))), "done": int(finished.group(1)),
            "succeeded": int(finished.group(2)), "mean": mean.group(1)}


def measure_grpc(url: str, body: Path, at: str, duration: float, pids: list[int]) -> dict[str, Any]:
    connections, streams = CONCURRENCY[at]
    before = run.cpu_seconds(pids)
    result = h2load(url, body, connections, streams, duration)
    spent = run.cpu_seconds(pids) - before
    result["cpu_us_per_call"] = round(spent / max(result["done"], 1) * 1e6, 1)
    return result


def echo_runs(procs: run.Processes, tmp: Path, duration: float) -> dict[str, dict[str, dict[str, Any]]]:
    script = tmp / "echo_server.py"
    script.write_text(ECHO_SERVER)
    body = tmp / "echo.bin"
    body.write_bytes(grpc_body(os.urandom(48)))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for kind in ECHO_SERVERS:
        port = run.free_port()
        process = procs.start(f"echo-{kind}", [sys.executable, str(script), kind, str(port)], env=env, cwd=ROOT)
        run.wait_for(lambda p=port: _listening(p), "listening", process, procs, f"echo-{kind}")  # type: ignore[misc]
        for at in CONCURRENCY:
            rows.setdefault(kind, {})[at] = measure_grpc(f"http://127.0.0.1:{port}{ECHO_PATH}", body, at, duration,
                                                         [process.pid])
        procs.stop(process)
    return rows


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --- 2. decisions: RLS (both servers) beside the check port -----------------------------------------

def start_gateway(procs: run.Processes, tmp: Path, name: str, upstream_port: int, redis_port: int,
                  rls_port: int, check_port: int | None, launcher: list[str]) -> run.Running:
    config = tmp / f"{name}.yaml"
    config.write_text(run.GATEWAY_CONFIG.format(upstream_port=upstream_port) + RLS_DOMAIN)
    port, admin_port = run.free_port(), run.free_port()
    args = [sys.executable, *launcher, "serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--admin-port", str(admin_port), "--workers", "1", "--redis-url", f"redis://127.0.0.1:{redis_port}",
            "--rls-port", str(rls_port)]
    if check_port is not None:
        args += ["--check-port", str(check_port)]
    env = dict(os.environ, GATEWAY_LOG_LEVEL="warning", GATEWAY_DRAIN_TIMEOUT="2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    process = procs.start(name, args, env=env, cwd=tmp)
    admin = f"http://127.0.0.1:{admin_port}"
    run.wait_for(lambda: run.http_get(admin + "/readyz")[0] == 200, "/readyz 200", process, procs, name)
    run.wait_for(lambda: _listening(rls_port), "the RLS port", process, procs, name)
    workers = [p for p in run.descendants(process.pid) if "spawn_main" in run.cmdline(p)]
    return run.Running(f"http://127.0.0.1:{port}", process, metrics_url=admin + "/metrics",
                       notes={"worker_pids": workers})


def rls_results(metrics_url: str) -> dict[str, float]:
    _, body = run.http_get(metrics_url)
    found: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("gateway_rls_calls_total{"):
            label = line.split('result="', 1)[1].split('"', 1)[0]
            found[label] = found.get(label, 0) + float(line.rsplit(" ", 1)[1])
    return found


def decision_runs(procs: run.Processes, tmp: Path, duration: float) -> dict[str, Any]:
    from gateway.rls import messages as pb

    upstream_port, redis_port = run.free_port(), run.free_port()
    run.start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1, run.upstream_server(upstream_port))
    run.start_redis(procs, tmp, redis_port)
    message = pb.RateLimitRequest(domain="bench")
    for key, value in (("user", "bench-user"), ("remote_address", "127.0.0.1"), ("global", "all")):
        message.descriptors.add().entries.add(key=key, value=value)
    body = tmp / "rls.bin"
    body.write_bytes(grpc_body(message.SerializeToString()))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    outcomes: dict[str, dict[str, float]] = {}
    floor = run.start_contender("floor", procs, tmp, upstream_port, redis_port)
    for at in CONCURRENCY:
        measured = check.measure(floor.url, int(at), duration, [floor.process.pid])
        rows.setdefault("floor", {})[at] = {"rps": measured["rps"], "mean": f"{measured['p50_us']}us (p50)",
                                            "cpu_us_per_call": measured["gateway_cpu_us_per_request"],
                                            "errors": measured["error_statuses"]}
    procs.stop(floor.process)
    rls_port, check_port = run.free_port(), run.free_port()
    gateway = start_gateway(procs, tmp, "gateway", upstream_port, redis_port, rls_port, check_port, ["-m", "gateway"])
    worker = gateway.notes["worker_pids"]
    for at in CONCURRENCY:
        rows.setdefault("rls", {})[at] = measure_grpc(f"http://127.0.0.1:{rls_port}{RLS_PATH}", body, at, duration,
                                                      worker)
        checked = check.measure(f"http://127.0.0.1:{check_port}", int(at), duration, worker, check.CHECK_SCRIPT)
        rows.setdefault("check", {})[at] = {"rps": checked["rps"], "mean": f"{checked['p50_us']}us (p50)",
                                            "cpu_us_per_call": checked["gateway_cpu_us_per_request"],
                                            "errors": checked["error_statuses"]}
    assert gateway.metrics_url is not None
    outcomes["rls"] = rls_results(gateway.metrics_url)
    atomicity = atomicity_case(rls_port)
    procs.stop(gateway.process)
    for kind in ("h2", "grpclib"):  # the comparisons (tests/support/rls_comparison.py)
        rls_port = run.free_port()
        other = start_gateway(procs, tmp, f"gateway-{kind}", upstream_port, redis_port, rls_port, None,
                              ["-m", "tests.support.rls_comparison", kind])
        for at in CONCURRENCY:
            rows.setdefault(f"rls-{kind}", {})[at] = measure_grpc(f"http://127.0.0.1:{rls_port}{RLS_PATH}", body,
                                                                  at, duration, other.notes["worker_pids"])
        assert other.metrics_url is not None
        outcomes[f"rls-{kind}"] = rls_results(other.metrics_url)
        procs.stop(other.process)
    return {"rows": rows, "outcomes": outcomes, "atomicity": atomicity, "upstream_port": upstream_port,
            "redis_port": redis_port}


def atomicity_case(port: int) -> dict[str, int]:
    """User A sends 5 on (user 3/min, site 5/min); how many of 3 does user B then get?"""
    from tests.support.rls_client import OK, RlsClient

    client = RlsClient(port)
    try:
        site = f"bench-{time.time_ns()}"
        a = sum(client.ask("site", [("user", "A" + site)], [("site", site)]).overall_code == OK for _ in range(5))
        b = sum(client.ask("site", [("user", "B" + site)], [("site", site)]).overall_code == OK for _ in range(3))
    finally:
        client.close()
    return {"a_admitted": a, "b_admitted": b}


# --- 3. through Envoy ---------------------------------------------------------------------------------

def envoy_local_ratelimit_config(port: int, upstream_port: int) -> str:
    return textwrap.dedent(f"""\
        static_resources:
          listeners:
          - name: front
            address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
            filter_chains:
            - filters:
              - name: envoy.filters.network.http_connection_manager
                typed_config:
                  "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                  stat_prefix: front
                  route_config:
                    virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                      - match: {{prefix: "/"}}
                        route: {{cluster: upstream}}
                  http_filters:
                  - name: envoy.filters.http.local_ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
                      stat_prefix: local
                      token_bucket: {{max_tokens: 1000000, tokens_per_fill: 1000000, fill_interval: 1s}}
                      filter_enabled: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
                      filter_enforced: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          clusters:
          - name: upstream
            type: STATIC
            connect_timeout: 2s
            load_assignment:
              cluster_name: upstream
              endpoints:
              - lb_endpoints:
                - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream_port}}}}}}}
        """)


def start_envoy(procs: run.Processes, tmp: Path, name: str, config: str, port: int) -> Any:
    from tests.support.front_proxies import envoy_binary

    path = tmp / f"{name}.yaml"
    path.write_text(config)
    process = procs.start(name, [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
                                 "--disable-hot-restart"], cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    run.wait_for(lambda: run.proxies_ok(url), "a 200 through it", process, procs, name)
    return process


def envoy_runs(procs: run.Processes, tmp: Path, duration: float, upstream_port: int,
               redis_port: int) -> dict[str, dict[str, Any]]:
    from tests.support.front_proxies import envoy_rls_config

    rows: dict[str, dict[str, Any]] = {}
    load = run.Load(2, 50, duration, min(1.0, duration))

    def measure(url: str, envoy: list[int], worker: list[int]) -> dict[str, Any]:
        """wrk's numbers, and the CPU per request of Envoy's process and of the gateway's worker."""
        run.wrk(url, run.Load(2, 50, load.warmup, 0), load.warmup)
        before = run.cpu_seconds(envoy), run.cpu_seconds(worker)
        result = run.wrk(url, load, duration)
        spent = run.cpu_seconds(envoy) - before[0], run.cpu_seconds(worker) - before[1]
        errors = result["errors"]
        requests = max(result["requests"], 1)
        return {"rps": round(requests / (result["duration_us"] / 1e6)),
                "p50_us": result["latency_us"]["p50"],
                "envoy_cpu_us": round(spent[0] / requests * 1e6, 1) if envoy else None,
                "gateway_cpu_us": round(spent[1] / requests * 1e6, 1) if worker else None,
                "errors": errors["status"] + errors["connect"] + errors["read"] + errors["timeout"]}

    def rls_config(port: int, rls_port: int) -> str:
        """The tests' recipe (domain `bench`: its user, remote_address and global descriptors)."""
        return envoy_rls_config(port, rls_port, "127.0.0.1", upstream_port, "bench", False).replace(
            "- request_headers: {header_name: x-user-id, descriptor_key: user}",
            "- request_headers: {header_name: x-user-id, descriptor_key: user}\n"
            "              - actions:\n"
            "                - remote_address: {}").replace(
            "generic_key: {descriptor_key: site, descriptor_value: main}",
            "generic_key: {descriptor_key: global, descriptor_value: all}")

    rls_port = run.free_port()
    gateway = start_gateway(procs, tmp, "gateway-envoy", upstream_port, redis_port, rls_port, None, ["-m", "gateway"])
    port = run.free_port()
    envoy = start_envoy(procs, tmp, "envoy-rls", rls_config(port, rls_port), port)
    worker = gateway.notes["worker_pids"]
    rows["Envoy + the gateway's RLS (1 + 1 worker)"] = measure(f"http://127.0.0.1:{port}", [envoy.pid], worker)
    assert gateway.metrics_url is not None
    rows["Envoy + the gateway's RLS (1 + 1 worker)"]["rls"] = rls_results(gateway.metrics_url)
    procs.stop(envoy)
    rows["the gateway's proxy port alone (1 worker)"] = measure(gateway.url, [], worker)
    procs.stop(gateway.process)
    # the ceiling: Envoy's own share, with an RLS that answers OK at once (no decision, no Redis)
    script = tmp / "ok_rls_server.py"
    script.write_text(ECHO_SERVER)
    free = run.free_port()
    server = procs.start("ok-rls", [sys.executable, str(script), "ok-rls", str(free)],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    run.wait_for(lambda: _listening(free), "listening", server, procs, "ok-rls")
    port = run.free_port()
    envoy = start_envoy(procs, tmp, "envoy-ok-rls", rls_config(port, free), port)
    rows["Envoy + an RLS that decides nothing (a constant OK on the gateway's HTTP/2 server)"] = measure(
        f"http://127.0.0.1:{port}", [envoy.pid], [server.pid])
    procs.stop(envoy)
    procs.stop(server)
    port = run.free_port()
    envoy = start_envoy(procs, tmp, "envoy-local", envoy_local_ratelimit_config(port, upstream_port), port)
    rows["Envoy local_ratelimit alone (1 worker)"] = measure(f"http://127.0.0.1:{port}", [envoy.pid], [])
    procs.stop(envoy)
    return rows


# --- report ---------------------------------------------------------------------------------------------

def ratio(decisions: dict[str, Any], at: str) -> float:
    rows = decisions["rows"]
    return float(round(rows["check"][at]["cpu_us_per_call"] / rows["rls"][at]["cpu_us_per_call"], 2))


def table(report: dict[str, Any]) -> list[str]:
    lines = ["**The gRPC library** (a bare unary echo; server CPU per call):", "",
             "| server | 1 call: calls/s | CPU/call | 50 concurrent: calls/s | CPU/call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for kind, label in ECHO_SERVERS.items():
        one, fifty = report["echo"][kind]["1"], report["echo"][kind]["50"]
        lines.append(f"| {label} | {one['rps']} | {one['cpu_us_per_call']:.0f} µs | {fifty['rps']} | "
                     f"{fifty['cpu_us_per_call']:.0f} µs |")
    rows = report["decisions"]["rows"]
    labels = {"rls": "RLS port, the gateway's server on libnghttp2 (1 worker, 3 descriptors)",
              "rls-h2": "RLS port, the gateway's server on h2 (comparison only)",
              "rls-grpclib": "RLS port on grpclib's server (comparison only)",
              "check": "check port (1 worker, the same 3 rules)",
              "floor": "the Python floor: bare uvloop + httptools, an empty 200 (HTTP/1.1, wrk)"}
    lines += ["", "**Decisions** (the gateway worker's CPU per decision):", "",
              "| | 1 call: decisions/s | mean latency | CPU/decision | 50 concurrent: decisions/s | mean latency | "
              "CPU/decision |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, label in labels.items():
        one, fifty = rows[key]["1"], rows[key]["50"]
        lines.append(f"| {label} | {one['rps']} | {one['mean']} | {one['cpu_us_per_call']:.0f} µs | {fifty['rps']} | "
                     f"{fifty['mean']} | {fifty['cpu_us_per_call']:.0f} µs |")
    outcomes = report["decisions"]["outcomes"]
    floor = rows["floor"]["50"]["cpu_us_per_call"]
    lines += ["", f"CPU per decision at 50 concurrent calls: RLS **{rows['rls']['50']['cpu_us_per_call'] / floor:.1f}x** "
              f"the floor's, check port **{rows['check']['50']['cpu_us_per_call'] / floor:.1f}x**; RLS / check port "
              f"**{rows['rls']['50']['cpu_us_per_call'] / rows['check']['50']['cpu_us_per_call']:.2f}** "
              "(the bar: at most 1.2)."]
    lines += ["", f"RLS decisions per core / the check port's: **{ratio(report['decisions'], '1')}** at 1 call, "
              f"**{ratio(report['decisions'], '50')}** at 50 (the bar: at least {TARGET_DECISIONS_PER_CORE}). "
              f"Calls by result: {outcomes}.",
              "", f"The atomicity case (per-user 3/min beside per-site 5/min): user A sends 5, "
              f"{report['decisions']['atomicity']['a_admitted']} pass; user B then gets "
              f"**{report['decisions']['atomicity']['b_admitted']}** of 3 (all or nothing: 2; "
              "envoyproxy/ratelimit, which counts A's refused calls on the site too: 0).",
              "", "**Through Envoy** (wrk -t2 -c50, the same upstream):", "",
              "| | requests/s | p50 | Envoy CPU/request | gateway worker CPU/request | error statuses |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]

    def cpu(value: float | None) -> str:
        return "" if value is None else f"{value:.0f} µs"

    for label, row in report["envoy"].items():
        lines.append(f"| {label} | {row['rps']} | {row['p50_us']} µs | {cpu(row.get('envoy_cpu_us'))} | "
                     f"{cpu(row.get('gateway_cpu_us'))} | {row['errors']} |")
    return lines


def write_docs(report: dict[str, Any], duration: float) -> None:
    run.write_doc_block(BEGIN, END, "Behind Envoy: the rate limit service",
                        f"python bench/rls.py --duration {duration:g} --docs", "h2load for gRPC, wrk for HTTP",
                        table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per measured run")
    parser.add_argument("--docs", action="store_true", help="write the tables into docs/benchmarks.md")
    parser.add_argument("--echo-only", action="store_true", help="only part 1, the bare echo servers")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-rls-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "logs").mkdir()
        procs = run.Processes(tmp / "logs")
        try:
            report: dict[str, Any] = {"echo": echo_runs(procs, tmp, args.duration)}
            if args.echo_only:
                for kind, label in ECHO_SERVERS.items():
                    print(label, report["echo"][kind])
                return 0
            report["decisions"] = decision_runs(procs, tmp, args.duration)
            report["envoy"] = envoy_runs(procs, tmp, args.duration, report["decisions"]["upstream_port"],
                                         report["decisions"]["redis_port"])
        finally:
            procs.stop_all()
    print("\n".join(table(report)))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.docs:
        write_docs(report, args.duration)
    return 0


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
