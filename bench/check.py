#!/usr/bin/env python3
"""The check endpoint (SPEC section 7) side by side with the proxy port, in one run:
`python bench/check.py` (`make bench` runs it after bench/run.py).

    proxy port        gateway, 1 worker, bench/run.py's 3-rule route, forwarding to the upstream
    check port        the same worker and route, asked the forward-auth question (bench/check.lua)
    nginx limit_req   nginx alone: proxy_pass + three limit_req zones, 1 worker (bench/run.py's)
    nginx + check     nginx (1 worker) with auth_request to the gateway's check port, then proxy_pass:
                      the deployment this endpoint is for

Every rule is far above the load, so all measure the admit path (wrk's error statuses are printed).
The gateway worker's CPU per request is read from /proc before and after each run; at 1
connection the runs are latency-bound, at 50 throughput-bound. The same upstream (nginx `return
200 "ok"`) and the same Redis serve all of them, each measured alone.

Results: a table on stdout, and with --docs the generated block of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: processes, nginx, wrk, CPU readings)

CHECK_SCRIPT = BENCH / "check.lua"
DOC = BENCH.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/check.py: begin -->", "<!-- bench/check.py: end -->"
FLOOR = "the Python floor: bare uvloop + httptools, an empty 200 (bench/floor_server.py)"


def nginx_auth_request_server(port: int, upstream_port: int, check_port: int) -> str:
    """docs/behind-a-proxy.md's nginx recipe, less the refusal's named location (nothing is refused)."""
    return textwrap.dedent(f"""\
        upstream backend {{
            server 127.0.0.1:{upstream_port};
            keepalive 128;
            keepalive_requests 1000000;
        }}
        upstream ratelimit {{
            server 127.0.0.1:{check_port};
            keepalive 128;
            keepalive_requests 1000000;
        }}
        server {{
            listen 127.0.0.1:{port} backlog=4096;
            location / {{
                auth_request /_ratelimit;
                auth_request_set $rl $upstream_http_ratelimit;
                add_header RateLimit $rl always;
                proxy_pass http://backend;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
            }}
            location = /_ratelimit {{
                internal;
                proxy_pass http://ratelimit;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
                proxy_pass_request_body off;
                proxy_set_header Content-Length "";
                proxy_set_header X-Original-URI $request_uri;
                proxy_set_header X-Original-Method $request_method;
                proxy_set_header Host $host;
            }}
        }}
        """)


def measure(url: str, connections: int, duration: float, pids: list[int], script: Path | None = None) -> dict[str, Any]:
    load = run.Load(1 if connections == 1 else 2, connections, duration, min(1.0, duration))
    run.wrk(url, run.Load(load.threads, load.connections, load.warmup, 0), load.warmup)  # warm-up
    before = run.cpu_seconds(pids)
    result = wrk(url, load, duration, script)
    spent = run.cpu_seconds(pids) - before
    requests = max(result["requests"], 1)
    errors = result["errors"]
    return {
        "rps": round(requests / (result["duration_us"] / 1e6)),
        "p50_us": result["latency_us"]["p50"],
        "gateway_cpu_us_per_request": round(spent / requests * 1e6, 1) if pids else None,
        "error_statuses": errors["status"] + errors["connect"] + errors["read"] + errors["timeout"],
    }


def wrk(url: str, load: run.Load, duration: float, script: Path | None) -> dict[str, Any]:
    if script is None:
        return run.wrk(url, load, duration)
    args = ["wrk", f"-t{load.threads}", f"-c{load.connections}", f"-d{max(1, round(duration))}s", "--latency",
            "--timeout", "5s", "-s", str(script), url + "/"]
    env = dict(os.environ, BENCH_REPORT_LUA=str(run.WRK_SCRIPT))  # check.lua builds on report.lua
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60, check=True, env=env)
    line = next(x for x in done.stdout.splitlines() if x.startswith("BENCH_JSON "))
    result: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measured run")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "logs").mkdir()
        procs = run.Processes(tmp / "logs")
        try:
            rows = _run(procs, tmp, args.duration)
        finally:
            procs.stop_all()
    _print(rows)
    if args.docs:
        _write_docs(rows, args.duration)
    return 0


def _run(procs: run.Processes, tmp: Path, duration: float) -> dict[str, dict[str, dict[str, Any]]]:
    upstream_port, redis_port = run.free_port(), run.free_port()
    run.start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1, run.upstream_server(upstream_port))
    run.start_redis(procs, tmp, redis_port)
    check_port = run.free_port()
    gateway = start_gateway(procs, tmp, upstream_port, redis_port, check_port)
    worker = gateway.notes["worker_pids"]
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    floor = run.start_contender("floor", procs, tmp, upstream_port, redis_port)
    for connections in (1, 50):
        rows.setdefault(FLOOR, {})[str(connections)] = measure(floor.url, connections, duration, [floor.process.pid])
    procs.stop(floor.process)
    for connections in (1, 50):
        at = str(connections)
        rows.setdefault("gateway proxy port (1 worker)", {})[at] = measure(gateway.url, connections, duration, worker)
        rows.setdefault("gateway check port (1 worker)", {})[at] = measure(
            f"http://127.0.0.1:{check_port}", connections, duration, worker, CHECK_SCRIPT)
    front_port = run.free_port()
    front = run.start_nginx(procs, "nginx-check", tmp / "nginx-check", front_port, 1,
                            nginx_auth_request_server(front_port, upstream_port, check_port))
    for connections in (1, 50):
        rows.setdefault("nginx + auth_request to the check port (1 + 1 worker)", {})[str(connections)] = measure(
            f"http://127.0.0.1:{front_port}", connections, duration, worker)
    procs.stop(front)
    procs.stop(gateway.process)
    nginx = run.start_contender("nginx", procs, tmp, upstream_port, redis_port)
    for connections in (1, 50):
        rows.setdefault("nginx limit_req alone (1 worker)", {})[str(connections)] = measure(
            nginx.url, connections, duration, [])
    return rows


def start_gateway(procs: run.Processes, tmp: Path, upstream_port: int, redis_port: int, check_port: int) -> run.Running:
    saved = os.environ.get("GATEWAY_CHECK_PORT")
    os.environ["GATEWAY_CHECK_PORT"] = str(check_port)  # start_contender passes the environment on
    try:
        return run.start_contender("gateway-1", procs, tmp, upstream_port, redis_port)
    finally:
        if saved is None:
            del os.environ["GATEWAY_CHECK_PORT"]
        else:
            os.environ["GATEWAY_CHECK_PORT"] = saved


def _ratio(rows: dict[str, dict[str, dict[str, Any]]], connections: str) -> float:
    check = rows["gateway check port (1 worker)"][connections]["gateway_cpu_us_per_request"]
    proxy = rows["gateway proxy port (1 worker)"][connections]["gateway_cpu_us_per_request"]
    return float(round(check / proxy, 2))


def _table(rows: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = ["| | 1 connection: requests/s | p50 | gateway CPU/request | 50 connections: requests/s | p50 | "
             "gateway CPU/request | error statuses |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, by in rows.items():
        one, fifty = by["1"], by["50"]

        def cpu(r: dict[str, Any]) -> str:
            return "" if r["gateway_cpu_us_per_request"] is None else f"{r['gateway_cpu_us_per_request']:.0f} µs"

        lines.append(f"| {label} | {one['rps']} | {one['p50_us']} µs | {cpu(one)} | {fifty['rps']} | "
                     f"{fifty['p50_us']} µs | {cpu(fifty)} | {one['error_statuses'] + fifty['error_statuses']} |")
    lines.append("")
    lines.append(f"Check port / proxy port, gateway CPU per decision: **{_ratio(rows, '1')}** at 1 connection, "
                 f"**{_ratio(rows, '50')}** at 50 (the bar: at most 0.6).")
    floor = rows[FLOOR]["50"]["gateway_cpu_us_per_request"]
    multiples = {label: rows[label]["50"]["gateway_cpu_us_per_request"] / floor
                 for label in ("gateway check port (1 worker)", "gateway proxy port (1 worker)")}
    lines.append("")
    lines.append("CPU per request as a multiple of the floor's, at 50 connections: check port **"
                 f"{multiples['gateway check port (1 worker)']:.1f}x** (the bar: at most 4x), proxy port "
                 f"**{multiples['gateway proxy port (1 worker)']:.1f}x** (it forwards as well).")
    return lines


def _print(rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    print("\n".join(_table(rows)))


def _write_docs(rows: dict[str, dict[str, dict[str, Any]]], duration: float) -> None:
    run.write_doc_block(BEGIN, END, "Behind another proxy: the check endpoint",
                        f"python bench/check.py --duration {duration:g} --docs", "wrk -t1 at 1 connection, -t2 at 50",
                        _table(rows))


if __name__ == "__main__":
    sys.exit(main())
