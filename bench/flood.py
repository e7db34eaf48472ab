#!/usr/bin/env python3
"""Issue 13's benchmark: one abusive client floods a route it is refused on while ten honest
clients use the same route, against a real gateway (1 worker), with refusals from memory on and off.

    python bench/flood.py                   # 20 s per phase (the issue's numbers)
    python bench/flood.py --duration 5      # a quick look

Phases, each with a fresh gateway on the same Redis (its keys flushed between):

    honest      the ten honest clients alone (1 request/s each): their latency without a flood
    flood-on    the same plus the abuser: wrk, 50 connections, one X-User-Id, as fast as it can;
                `local_refusals: {max_entries: 100000}` (the default)
    flood-off   the same with `local_refusals: {max_entries: 0}`: every request asks Redis

The route: token_bucket per user (10/s, burst 20) and a global gcra far above the load, so the
abuser is admitted at its rate and refused the rest, and each honest client is always admitted.
The upstream is nginx `return 200`; Redis is a dedicated redis-server. Reported: Redis script
calls per refused request (every EVALSHA/EVAL the abuser caused, its admissions included, over its
refusals; target < 0.01), refusals per second of the worker, on and off (target: on >= 3x off),
and the honest clients' p50/p99 in each phase. JSON in bench/out/flood.json; a Markdown block on
stdout for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from run import (
    BENCH,
    OUT,
    Processes,
    cmdline,
    descendants,
    free_port,
    gateway_outcomes,
    git_describe,
    http_get,
    machine,
    redis_calls,
    redis_command,
    start_nginx,
    start_redis,
    upstream_server,
    wait_for,
)

HONEST = 10
ABUSER = "flood-abuser"
CONFIG = """\
version: 1
redis: {{timeout: 50ms, key_prefix: flood}}
local_refusals: {{max_entries: {max_entries}}}
defaults: {{failure_mode: closed, headers: draft}}
upstreams:
  upstream: {{url: "http://127.0.0.1:{upstream_port}", timeout: 10s, max_connections: 512}}
routes:
  - name: api
    match: {{path: "/{{rest:path}}"}}
    upstream: upstream
    limits:
      - {{name: user, by: [header:X-User-Id], algorithm: token_bucket, rate: 10/s, burst: 20}}
      - {{name: global, by: [], algorithm: gcra, rate: 1000000/s, burst: 1000000}}
"""
WRK_SCRIPT = """\
dofile("{report}")
wrk.headers["X-User-Id"] = "{abuser}"
"""
# --vary: every request of the abuser carries a new X-Request-Id, so no two are the same bytes and
# the fast lane for exact repeats (gateway/repeats.py) never applies: each is read and matched
VARY_SCRIPT = """\
local n = 0
request = function()
  n = n + 1
  wrk.headers["X-Request-Id"] = "abuse-" .. n
  return wrk.format(nil)
end
"""


def start_gateway(procs: Processes, tmp: Path, name: str, upstream_port: int, redis_port: int,
                  max_entries: int) -> tuple[str, str, Any]:
    port, admin_port = free_port(), free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(CONFIG.format(max_entries=max_entries, upstream_port=upstream_port))
    gateway = shutil.which("gateway", path=str(Path(sys.executable).parent)) or "gateway"
    args = [gateway, "serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--admin-port", str(admin_port), "--workers", "1", "--redis-url", f"redis://127.0.0.1:{redis_port}"]
    env = dict(os.environ, GATEWAY_LOG_LEVEL="warning", GATEWAY_DRAIN_TIMEOUT="2")
    process = procs.start(name, args, env=env, cwd=tmp)
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: http_get(admin + "/readyz")[0] == 200, "/readyz 200", process, procs, name)
    wait_for(lambda: http_get(url + "/x", {"X-User-Id": "warm"})[0] == 200, "a 200 through it", process, procs, name)
    workers = [p for p in descendants(process.pid) if "spawn_main" in cmdline(p)]
    if len(workers) != 1:
        raise RuntimeError(f"{name}: expected 1 worker, found {workers}")
    return url, admin, process


def script_calls(redis_port: int) -> int:
    stats = redis_calls(redis_port)
    return int(stats.get("evalsha", {}).get("calls", 0) + stats.get("eval", {}).get("calls", 0))


def abuse(url: str, script: Path, connections: int, duration: float) -> dict[str, Any]:
    """The abusive client: wrk with one thread and `connections` connections, as fast as it can."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", "--timeout", "5s",
            "-s", str(script), url + "/api/items/1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr or done.stdout}")
    result: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
    return result


class Honest(threading.Thread):
    """One honest client: a keep-alive connection, one request a second, each one timed."""

    def __init__(self, port: int, n: int, duration: float) -> None:
        super().__init__(daemon=True)
        self.port, self.user, self.duration = port, f"honest-{n}", duration
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.offset = n / HONEST  # spread over the second

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        start = time.monotonic() + self.offset
        k = 0
        while True:
            due = start + k
            if due > start + self.duration - 1:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            sent = time.perf_counter()
            connection.request("GET", f"/api/items/{k}", headers={"X-User-Id": self.user})
            response = connection.getresponse()
            response.read()
            self.latencies.append((time.perf_counter() - sent) * 1000)
            self.statuses[response.status] = self.statuses.get(response.status, 0) + 1
            k += 1
        connection.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def phase(name: str, procs: Processes, tmp: Path, upstream_port: int, redis_port: int, duration: float,
          max_entries: int, flood: bool, connections: int, vary: bool = False) -> dict[str, Any]:
    redis_command(redis_port, "FLUSHALL")
    url, admin, process = start_gateway(procs, tmp, name, upstream_port, redis_port, max_entries)
    port = int(url.rsplit(":", 1)[1])
    try:
        before_calls = script_calls(redis_port)
        before = gateway_outcomes(admin + "/metrics")
        clients = [Honest(port, n, duration) for n in range(HONEST)]
        for client in clients:
            client.start()
        result: dict[str, Any] = {"max_entries": max_entries}
        if flood:
            script = tmp / "flood.lua"
            script.write_text(WRK_SCRIPT.format(report=BENCH / "report.lua", abuser=ABUSER)
                              + (VARY_SCRIPT if vary else ""))
            result["wrk"] = abuse(url, script, connections, duration)
        for client in clients:
            client.join(duration + 30)
        time.sleep(1.2)  # the worker flushes its counters every second
        after = gateway_outcomes(admin + "/metrics")
        calls = script_calls(redis_port) - before_calls
    finally:
        procs.stop(process)
    outcomes = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    latencies = [x for c in clients for x in c.latencies]
    statuses: dict[int, int] = {}
    for c in clients:
        for status, count in c.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    honest_requests = len(latencies)
    refused = outcomes.get("refused", 0.0)  # from Redis or from memory (refused_locally, a part of it)
    abuser_calls = calls - honest_requests
    result.update({
        "duration_s": duration,
        "honest": {"requests": honest_requests, "statuses": statuses,
                   "p50_ms": round(statistics.median(latencies), 2), "p99_ms": round(percentile(latencies, 99), 2),
                   "max_ms": round(max(latencies), 2)},
        "outcomes": outcomes,
        "redis_script_calls": calls,
    })
    if flood:
        seconds = result["wrk"]["duration_us"] / 1e6
        result.update({
            "refused": refused,
            "refused_locally": outcomes.get("refused_locally", 0.0),
            "refusals_per_s": round(refused / seconds, 1),
            "abuser_admitted": outcomes.get("admitted", 0.0) - honest_requests,
            "redis_calls_per_refusal": round(abuser_calls / refused, 5) if refused else None,
        })
    return result


def markdown(report: dict[str, Any]) -> str:
    phases = report["phases"]
    on, off, alone = phases["flood-on"], phases["flood-off"], phases["honest"]
    ratio = on["refusals_per_s"] / off["refusals_per_s"]
    lines = [
        f"Run {report['started']} UTC, commit {report['commit']}, {report['machine']['nproc']} cores "
        f"({report['machine']['cpu_model']}), {report['duration_s']:.0f} s per phase"
        + (", the abuser sending a new X-Request-Id with every request (`--vary`):" if report.get("vary") else ":"),
        "",
        "| measure | cache on | cache off | target |",
        "| --- | ---: | ---: | ---: |",
        f"| refusals per second (1 worker) | {on['refusals_per_s']:,.0f} | {off['refusals_per_s']:,.0f} | "
        f"on >= 3x off: **{ratio:.1f}x** |",
        f"| Redis script calls per refused request | {on['redis_calls_per_refusal']:.4f} | "
        f"{off['redis_calls_per_refusal']:.4f} | < 0.01 |",
        f"| refused from memory | {on['refused_locally']:,.0f} of {on['refused']:,.0f} | "
        f"{off['refused_locally']:,.0f} of {off['refused']:,.0f} | |",
        f"| abuser admitted (10/s, burst 20) | {on['abuser_admitted']:,.0f} | {off['abuser_admitted']:,.0f} | |",
        f"| honest p50 / p99, ms (alone: {alone['honest']['p50_ms']:.2f} / {alone['honest']['p99_ms']:.2f}) | "
        f"{on['honest']['p50_ms']:.2f} / {on['honest']['p99_ms']:.2f} | "
        f"{off['honest']['p50_ms']:.2f} / {off['honest']['p99_ms']:.2f} | |",
        f"| honest requests, statuses | {on['honest']['requests']} {on['honest']['statuses']} | "
        f"{off['honest']['requests']} {off['honest']['statuses']} | |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase (20)")
    parser.add_argument("--connections", type=int, default=50, help="the abuser's connections (50)")
    parser.add_argument("--vary", action="store_true",
                        help="the abuser sends a new X-Request-Id with every request (no exact repeats)")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (make system-deps, or apt-get install wrk)")
    OUT.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": " ".join(["bench/flood.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_describe(),
        "duration_s": args.duration,
        "vary": args.vary,
        "machine": machine(),
        "phases": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="gateway-flood-"))
    procs = Processes(tmp)
    try:
        upstream_port, redis_port = free_port(), free_port()
        start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1, upstream_server(upstream_port))
        start_redis(procs, tmp / "redis", redis_port)
        for name, max_entries, flood in (("honest", 100_000, False), ("flood-on", 100_000, True),
                                         ("flood-off", 0, True)):
            print(f"== {name}", flush=True)
            result = phase(name, procs, tmp, upstream_port, redis_port, args.duration, max_entries, flood,
                           args.connections, args.vary)
            report["phases"][name] = result
            print(json.dumps({k: v for k, v in result.items() if k != "wrk"}), flush=True)
    finally:
        procs.stop_all()
    (OUT / ("flood-vary.json" if args.vary else "flood.json")).write_text(json.dumps(report, indent=2))
    print()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
