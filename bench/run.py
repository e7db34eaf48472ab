#!/usr/bin/env python3
"""The gateway's benchmark, side by side in one run: `make bench` (or `python bench/run.py`).

Contenders, measured one after another against the SAME upstream and the SAME Redis, each alone on
the machine while it is measured (the others are not running):

    nginx       nginx proxy_pass + three limit_req zones (per user, per IP, global), 1 worker
    nginx-2     the same with worker_processes 2 (= auto on a 2-core box), for reference
    naive       Starlette + one shared httpx.AsyncClient + one EVALSHA per request (redis.asyncio),
                uvicorn, 1 worker (bench/naive_forwarder.py): pathological (encode/httpx#3215)
    peer        the fair peer: Starlette + one shared aiohttp ClientSession + one EVALSHA per
                request (redis-py with hiredis), uvicorn with uvloop and httptools, 1 worker
                (bench/fair_peer.py)
    gateway-1   this gateway, 1 worker, a 3-rule route (token_bucket per user, sliding_window per
                IP, gcra global), failure_mode closed so a Redis problem would show as a 503
    gateway-2   the same with 2 workers

Every rule's limit is far above the load, so all contenders measure the admit path; wrk's count of
error statuses (>= 400) proves it and is reported, and for the gateway so are its own
`gateway_requests_total` outcomes from /metrics.

Low load: most gateways spend most of their day with a few requests in flight, where batching
gives nothing. At 1 and 8 connections (wrk -t1 --latency, `--low-load-duration` s each) the
upstream direct, nginx, the fair peer, and gateway-1 on a route with no limits (/open/...) and on
its 3-rule route are measured for p50, p99 and the server's CPU per request, the server alone on
the last CPU and everything else on the others; gateway-1's two routes also at the main load, so a
decision's own CPU (3-rule minus no-limit, per request) is known both alone and batched. Beside
them: a bare Redis round trip (bench/redis_client.py --round-trips: a lone EVALSHA of `return 1`,
the floor under a lone decision), over TCP and over a unix socket, and gateway-1's routes again
with Redis over the unix socket.

The upstream is a separate nginx (1 worker) answering `return 200 "ok"`; Redis is a dedicated
redis-server with persistence off. Load: wrk -t2 -c50, a short warm-up, then the measured run.
Afterwards the gateway (1 worker) is profiled under the same load, alone on one CPU: py-spy (when
installed) for the Python side, split by area in bench/profile_areas.py, then perf (when it works)
for the native side: kernel, interpreter, garbage collector, C extensions.

Results: a table on stdout, JSON in bench/out/, and (full runs) the generated block of
docs/benchmarks.md. `--only gateway-1 --duration 3` for quick iterations.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profile_areas import breakdown, perf_breakdown, render_breakdown, render_perf

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
DOCS = ROOT / "docs" / "benchmarks.md"
WRK_SCRIPT = BENCH / "report.lua"
REQUEST_PATH = "/api/items/42"
USER_HEADER = ("X-User-Id", "bench-user")
CONTENDERS = ("floor", "nginx", "nginx-2", "naive", "peer", "gateway-1", "gateway-2", "gateway-uvicorn",
              "gateway-httpx", "gateway-keys")
# The gateway (1 worker) with the libraries' own implementation in place of each lean part behind
# its seam: uvicorn's httptools protocol and httpx's AsyncHTTPTransport, built by
# tests/support/comparison_gateway.py (no product setting selects them: both fail parts of tests/conformance).
COMPARISONS = {"gateway-uvicorn": ["--http", "uvicorn"], "gateway-httpx": ["--transport", "httpx"]}
LABELS = {
    "floor": "the Python floor: bare uvloop + httptools, an empty 200 (bench/floor_server.py)",
    "nginx": "nginx proxy_pass + limit_req (1 worker)",
    "nginx-2": "nginx proxy_pass + limit_req (2 workers)",
    "naive": "naive Starlette + httpx + EVALSHA (1 worker)",
    "peer": "fair peer: Starlette + aiohttp + redis-py EVALSHA (1 worker)",
    "gateway-1": "gateway, 3-rule route (1 worker)",
    "gateway-2": "gateway, 3-rule route (2 workers)",
    "gateway-uvicorn": "gateway, 1 worker, uvicorn's own HTTP protocol",
    "gateway-httpx": "gateway, 1 worker, httpx's own upstream transport",
    "gateway-keys": "gateway, 3-rule route (1 worker), API keys: the caller's plan looked up per request",
}
# gateway-keys: the same gateway with `keys:` (gateway/api_keys.py) reading the bench's user header as
# the API key, registered (with 100,000 others) before it is measured: a plan lookup per request
KEYS_SECTION = 'keys: {source: "header:X-User-Id", plans: [free, pro]}\n'
REGISTERED_KEYS = 100_000
DOC_START = "<!-- bench:results:start (generated by bench/run.py; edits here are overwritten) -->"
DOC_END = "<!-- bench:results:end -->"
TARGET_NAIVE = 10.0   # gateway (1 worker) at least 10x the naive forwarder
TARGET_NGINX = 0.10   # ... and at least 0.10 of nginx's throughput, same run
TARGET_PEER = 1.5     # ... and at least 1.5x the fair peer (Starlette + aiohttp + redis-py)
TARGET_LONE_P50 = 1.3  # at 1 connection: the 3-rule route's p50 at most 1.3x the no-limit route's
TARGET_LONE_CPU = 2.0  # a lone decision's worker CPU at most 2x a batched one's
OPEN_PREFIX = "/open"  # gateway routes: /open/... has no limits, everything else the 3-rule route
LOW_LOAD = {  # row label: (contender whose process serves it, path prefix)
    "upstream direct (nginx return 200)": ("upstream", ""),
    "nginx proxy_pass + limit_req (1 worker)": ("nginx", ""),
    "fair peer (1 worker)": ("peer", ""),
    "gateway, a route with no limits (1 worker)": ("gateway-1", OPEN_PREFIX),
    "gateway, 3-rule route (1 worker)": ("gateway-1", ""),
}
ROUND_TRIP = "a bare Redis round trip (EVALSHA of `return 1`, redis-py `Connection`, uvloop)"
ROUND_TRIP_UNIX = ROUND_TRIP.replace("round trip", "round trip over a unix socket")
UNIX_ROUTES = {  # the same gateway with Redis over a unix socket: low load only
    "gateway over a unix socket to Redis, a route with no limits": OPEN_PREFIX,
    "gateway over a unix socket to Redis, 3-rule route": "",
}


# --- processes ---------------------------------------------------------------------------------


class Processes:
    """Everything started here, each in its own process group, stopped in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=cwd, start_new_session=True,
            )
        self.running.append((name, process))
        return process

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self, process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
        self.running = [(n, p) for n, p in self.running if p is not process]
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        # the group may outlive its leader (nginx or gateway workers): make sure it is gone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)

    def stop_all(self) -> None:
        for _, process in reversed(list(self.running)):
            self.stop(process)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], bool], what: str, process: subprocess.Popen[bytes],
             procs: Processes, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} before {what}:\n{procs.log(name)}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name}: {what} not within {timeout:.0f}s:\n{procs.log(name)}")


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def register_keys(admin: str) -> None:
    """The bench's user as an API key, and REGISTERED_KEYS others, through the admin port's POST /keys."""
    keys = [{"key": USER_HEADER[1], "plan": "free"}] + [
        {"key": f"other-{n}", "plan": "pro"} for n in range(REGISTERED_KEYS - 1)]
    for at in range(0, len(keys), 10_000):
        body = json.dumps({"keys": keys[at:at + 10_000]}).encode()
        request = urllib.request.Request(admin + "/keys", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200


def proxies_ok(url: str) -> bool:
    """One request through the contender reaches the upstream and comes back as 200 'ok'."""
    status, body = http_get(url + REQUEST_PATH, dict([USER_HEADER]))
    return status == 200 and body == b"ok"


def descendants(pid: int) -> list[int]:
    """pid and every process below it (nginx and gateway workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def io_syscalls(pids: list[int]) -> tuple[int, int]:
    """read- and write-family system calls made so far by these processes (/proc/<pid>/io)."""
    reads = writes = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/io").read_text()
        except OSError:
            continue
        values = dict(line.split(": ") for line in text.splitlines() if ": " in line)
        reads += int(values.get("syscr", 0))
        writes += int(values.get("syscw", 0))
    return reads, writes


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_quiet(threshold: float, longest: float = 30.0) -> float:
    """Wait (at most `longest` s) until the machine's CPUs are busy less than `threshold` cores over
    a second, with nothing of ours under load. Returns the last reading."""
    deadline = time.monotonic() + longest
    while True:
        before = machine_busy_seconds()
        time.sleep(1.0)
        busy = machine_busy_seconds() - before
        if busy < threshold or time.monotonic() > deadline:
            return round(busy, 2)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --- the fixed parts: upstream, Redis ----------------------------------------------------------


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not found:
        raise SystemExit("nginx not found (make system-deps, or apt-get install nginx)")
    return found


def nginx_config(workdir: Path, workers: int, server: str) -> Path:
    """An nginx.conf that runs as the current user with every path in workdir."""
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    user = ""
    if os.geteuid() == 0:  # workers would otherwise switch to "nobody"; stay the current user
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};"
    http = textwrap.dedent(f"""\
        access_log off;
        client_body_temp_path {workdir}/client_body;
        proxy_temp_path {workdir}/proxy;
        fastcgi_temp_path {workdir}/fastcgi;
        uwsgi_temp_path {workdir}/uwsgi;
        scgi_temp_path {workdir}/scgi;
        keepalive_requests 1000000;
        keepalive_timeout 75s;
        """) + server
    conf = workdir / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        {user}
        worker_processes {workers};
        daemon off;
        pid {workdir}/nginx.pid;
        error_log {workdir}/error.log warn;
        events {{ worker_connections 4096; }}
        """) + "http {\n" + textwrap.indent(http, "    ") + "}\n")
    return conf


def start_nginx(procs: Processes, name: str, workdir: Path, port: int, workers: int,
                server: str) -> subprocess.Popen[bytes]:
    conf = nginx_config(workdir, workers, server)
    args = [nginx_binary(), "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log")]
    process = procs.start(name, args)

    def listening() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True

    wait_for(listening, f"port {port} open", process, procs, name)
    return process


def upstream_server(port: int) -> str:
    return textwrap.dedent(f"""\
        server {{
            listen 127.0.0.1:{port} backlog=4096;
            location / {{
                default_type text/plain;
                return 200 "ok";
            }}
        }}
        """)


def nginx_proxy_server(port: int, upstream_port: int) -> str:
    # Three zones, like the gateway's three rules; rates and bursts far above the load: never refuses.
    return textwrap.dedent(f"""\
        limit_req_zone $http_x_user_id zone=user:10m rate=1000000r/s;
        limit_req_zone $binary_remote_addr zone=ip:10m rate=1000000r/s;
        limit_req_zone $server_name zone=global:1m rate=1000000r/s;
        limit_req_status 429;
        upstream backend {{
            server 127.0.0.1:{upstream_port};
            keepalive 128;
            keepalive_requests 1000000;
        }}
        server {{
            listen 127.0.0.1:{port} backlog=4096;
            server_name bench;       # the global zone's key: an empty key would not be accounted
            location / {{
                limit_req zone=user burst=1000000 nodelay;
                limit_req zone=ip burst=1000000 nodelay;
                limit_req zone=global burst=1000000 nodelay;
                proxy_pass http://backend;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
            }}
        }}
        """)


def redis_binary() -> str:
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    from gateway.embedded import redis_server_binary

    return redis_server_binary()


def start_redis(procs: Processes, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    """On 127.0.0.1:`port` and on the unix socket workdir/redis.sock."""
    workdir.mkdir(parents=True, exist_ok=True)
    process = procs.start("redis", [
        redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--unixsocket", str(workdir / "redis.sock"), "--unixsocketperm", "700",
        "--dir", str(workdir), "--daemonize", "no", "--loglevel", "warning",
    ])

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")

    wait_for(pong, "PONG", process, procs, "redis")
    return process


def redis_command(port: int, *args: str) -> bytes:
    payload = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(payload)
        return sock.recv(65536)


# --- contenders --------------------------------------------------------------------------------


@dataclass
class Running:
    url: str
    process: subprocess.Popen[bytes]
    profile_pid: int | None = None        # the process py-spy should sample (gateway worker)
    metrics_url: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)


GATEWAY_CONFIG = """\
version: 1
redis:
  timeout: 50ms
  key_prefix: bench
defaults:
  failure_mode: closed       # a Redis timeout or error would be a 503, visible in wrk's errors
  headers: draft
upstreams:
  upstream:
    url: http://127.0.0.1:{upstream_port}
    timeout: 10s
    connect_timeout: 1s
    max_connections: 512
routes:
  - name: open               # no limits: the proxy alone, for the low-load table
    match: {{path: "/open/{{rest:path}}"}}
    upstream: upstream
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: upstream
    limits:                  # far above the load: everything is admitted, every rule is evaluated
      - {{name: user, by: [header:X-User-Id], on_missing: ip, algorithm: token_bucket, rate: 1000000/s, burst: 1000000}}
      - {{name: ip, by: [ip], algorithm: sliding_window, limit: 1000000000, window: 1s}}
      - {{name: global, by: [], algorithm: gcra, rate: 1000000/s, burst: 1000000}}
"""


def start_contender(name: str, procs: Processes, tmp: Path, upstream_port: int, redis_port: int,
                    redis_url: str | None = None) -> Running:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    redis_url = redis_url or f"redis://127.0.0.1:{redis_port}"
    if name in ("nginx", "nginx-2"):
        workers = 2 if name == "nginx-2" else 1
        process = start_nginx(procs, name, tmp / name, port, workers, nginx_proxy_server(port, upstream_port))
        wait_for(lambda: proxies_ok(url), "a 200 through it", process, procs, name)
        return Running(url, process, notes={"worker_processes": workers})
    if name == "floor":
        process = procs.start(name, [sys.executable, str(BENCH / "floor_server.py"), str(port)], cwd=ROOT)
        wait_for(lambda: http_get(url + REQUEST_PATH)[0] == 200, "a 200 from it", process, procs, name)
        return Running(url, process, profile_pid=process.pid)
    if name in ("naive", "peer"):
        env = dict(os.environ, UPSTREAM_URL=f"http://127.0.0.1:{upstream_port}", REDIS_URL=redis_url)
        module = "naive_forwarder:app" if name == "naive" else "fair_peer:app"
        process = procs.start(name, [
            sys.executable, "-m", "uvicorn", module, "--app-dir", str(BENCH),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--loop", "uvloop", "--http", "httptools",
            "--no-access-log", "--log-level", "warning",
        ], env=env, cwd=ROOT)
        wait_for(lambda: proxies_ok(url), "a 200 through it", process, procs, name)
        return Running(url, process, profile_pid=process.pid)
    workers = 2 if name == "gateway-2" else 1
    config = tmp / f"{name}.yaml"
    text = GATEWAY_CONFIG.format(upstream_port=upstream_port)
    config.write_text(text.replace("routes:\n", KEYS_SECTION + "routes:\n", 1) if name == "gateway-keys" else text)
    admin_port = free_port()
    launcher = [sys.executable, "-m", "gateway"]
    if name in COMPARISONS:
        launcher = [sys.executable, "-m", "tests.support.comparison_gateway", *COMPARISONS[name]]
    args = [*launcher, "serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--admin-port", str(admin_port), "--workers", str(workers), "--redis-url", redis_url]
    env = dict(os.environ, GATEWAY_LOG_LEVEL="warning", GATEWAY_DRAIN_TIMEOUT="2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    process = procs.start(name, args, env=env, cwd=tmp)
    admin = f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: http_get(admin + "/readyz")[0] == 200, "/readyz 200", process, procs, name)
    if name == "gateway-keys":
        register_keys(admin)
    wait_for(lambda: proxies_ok(url), "a 200 through it", process, procs, name)
    spawned = [p for p in descendants(process.pid) if "spawn_main" in cmdline(p)]
    if len(spawned) != workers:
        raise RuntimeError(f"{name}: expected {workers} worker(s), found {spawned}")
    return Running(url, process, profile_pid=spawned[0], metrics_url=admin + "/metrics",
                   notes={"workers": workers, "worker_pids": spawned})


def gateway_outcomes(metrics_url: str) -> dict[str, float]:
    """gateway_requests_total by outcome (summed over workers) and refused rule decisions."""
    _, text = http_get(metrics_url)
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        m = re.match(r'gateway_requests_total\{([^}]*)\} (\S+)', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = labels.get("outcome", "?")
            out[key] = out.get(key, 0.0) + float(m.group(2))
            if labels.get("decided_by") == "memory":  # refusals answered from the worker's memory
                out["refused_locally"] = out.get("refused_locally", 0.0) + float(m.group(2))
        m = re.match(r'gateway_rule_decisions_total\{([^}]*)\} (\S+)', line)
        if m and 'outcome="refused"' in m.group(1):
            out["rule_refusals"] = out.get("rule_refusals", 0.0) + float(m.group(2))
        m = re.match(r'gateway_redis_errors_total\{([^}]*)\} (\S+)', line)
        if m:
            out["redis_errors"] = out.get("redis_errors", 0.0) + float(m.group(2))
    return out


# --- load ----------------------------------------------------------------------------------------


@dataclass
class Load:
    threads: int
    connections: int
    duration: float
    warmup: float


def low_load(running: Running, label: str, prefix: str, connections: list[int], duration: float,
             main_load: Load, shared: dict[str, list[int]], redis_port: int) -> dict[str, dict[str, float]]:
    """p50, p99 and the serving processes' CPU per request at each number of connections (wrk -t1);
    for the gateway's routes also at the main load (the batched reference).

    At low load the server runs alone on the last CPU, and wrk, the upstream and Redis on the
    others. Left to the scheduler, the same route's p50 at 1 connection moved between 120 and
    250 µs from one run to the next, by whether the processes it woke shared its CPU (on this VM a
    wake-up on another CPU costs tens of µs each way); pinned, every hop crosses CPUs, as it does
    when the upstream and Redis are other machines, and runs agree within ~10%."""
    out = {}
    at = running.url + prefix
    loads = [Load(1, n, duration, min(1.0, duration)) for n in connections]
    if running.metrics_url:  # the gateway: both routes under the main load too, for the decision's own CPU
        loads.append(Load(main_load.threads, main_load.connections, duration, min(1.0, duration)))
    servers = [running.process.pid, *descendants(running.process.pid)]
    for load in loads:
        wait_quiet(0.3, longest=5)
        pinned = alone(servers, shared) if load.connections in connections else contextlib.nullcontext(None)
        with pinned as cpus:
            r = measure(Running(at, running.process), load, shared, redis_port, cpus)
        out[str(load.connections)] = {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "rps": r["rps"],
                                      "cpu_us_per_request": r["proxy_cpu_us_per_request"],
                                      "error_statuses": r["error_statuses"], "other": r["cpu_cores"]["other"]}
        print(f"   {label}, {load.connections} connection(s): p50 {r['p50_ms'] * 1000:.0f} µs, "
              f"p99 {r['p99_ms'] * 1000:.0f} µs, {r['proxy_cpu_us_per_request']:.0f} µs CPU/request", flush=True)
    return out


def round_trips(url: str, seconds: float, redis_pid: int) -> dict[str, float]:
    """The floor under a lone decision: bench/redis_client.py's lone EVALSHA of `return 1`, the
    client on the last CPU and Redis on the others, as the gateway's worker at low load."""
    cpus = sorted(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {cpus[-1]})) if len(cpus) > 1 else None
    with alone([], {"redis": [redis_pid]}):
        done = subprocess.run([sys.executable, str(BENCH / "redis_client.py"), "--url", url, "--round-trips",
                               str(seconds)], capture_output=True, text=True, timeout=seconds + 60, check=True,
                              preexec_fn=pin)
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def wrk(url: str, load: Load, duration: float, cpus: set[int] | None = None) -> dict[str, Any]:
    args = ["wrk", f"-t{load.threads}", f"-c{load.connections}", f"-d{max(1, round(duration))}s", "--latency",
            "--timeout", "5s", "-s", str(WRK_SCRIPT), url + REQUEST_PATH]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60, check=False, preexec_fn=pin)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr or done.stdout}")
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no BENCH_JSON line:\n{done.stdout}")
    result: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
    result["wrk_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result["wrk_text"] = done.stdout.replace(line, "").strip()
    return result


def redis_calls(port: int) -> dict[str, dict[str, float]]:
    """INFO commandstats: calls and microseconds per call, by command."""
    out = {}
    for line in redis_command(port, "INFO", "commandstats").decode(errors="replace").splitlines():
        m = re.match(r"cmdstat_(\w+):calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", line)
        if m:
            out[m.group(1)] = {"calls": int(m.group(2)), "usec_per_call": float(m.group(4))}
    return out


def measure(running: Running, load: Load, shared: dict[str, list[int]], redis_port: int,
            cpus: set[int] | None = None) -> dict[str, Any]:
    if load.warmup > 0:
        wrk(running.url, load, load.warmup, cpus)
    redis_command(redis_port, "CONFIG", "RESETSTAT")
    proxy_pids = descendants(running.process.pid)
    groups = {"proxy": proxy_pids, **shared}
    cpu_before = {k: cpu_seconds(v) for k, v in groups.items()}
    busy_before = machine_busy_seconds()
    io_before = io_syscalls(proxy_pids)
    started = time.monotonic()
    result = wrk(running.url, load, load.duration, cpus)
    wall = time.monotonic() - started
    cpu = {k: round((cpu_seconds(v) - cpu_before[k]) / wall, 3) for k, v in groups.items()}
    cpu["wrk"] = round(result.pop("wrk_cpu_s") / wall, 3)
    io_after = io_syscalls(proxy_pids)
    # everything else the machine did meanwhile: kernel work not charged to a process, and other
    # people's jobs on a shared box (the reason to look at this column before trusting a run)
    cpu["other"] = max(0.0, round((machine_busy_seconds() - busy_before) / wall - sum(cpu.values()), 3))
    redis = redis_calls(redis_port)
    seconds = result["duration_us"] / 1e6
    errors = result["errors"]
    return {
        "rps": result["requests"] / seconds,
        "requests": result["requests"],
        "seconds": seconds,
        "p50_ms": result["latency_us"]["p50"] / 1000,
        "p90_ms": result["latency_us"]["p90"] / 1000,
        "p99_ms": result["latency_us"]["p99"] / 1000,
        "max_ms": result["latency_us"]["max"] / 1000,
        "error_statuses": errors["status"],          # responses with status >= 400
        "socket_errors": {k: v for k, v in errors.items() if k != "status"},
        "cpu_cores": cpu,                            # cores busy on average, per process group
        "proxy_cpu_us_per_request": cpu["proxy"] * 1e6 / (result["requests"] / seconds),
        # system calls of the proxy per request, reads (recv, read) and writes (send, write, writev)
        "proxy_syscalls_per_request": {
            "read": round((io_after[0] - io_before[0]) / max(1, result["requests"]), 2),
            "write": round((io_after[1] - io_before[1]) / max(1, result["requests"]), 2),
        },
        "redis_commands": redis,                     # during the measured run only
        "wrk_text": result["wrk_text"],
    }


@contextlib.contextmanager
def worker_alone(running: Running, shared: dict[str, list[int]]) -> Iterator[set[int] | None]:
    """While profiling: the worker alone on the last CPU, upstream, Redis and wrk on the others.

    Sharing a CPU, the worker is often preempted right after a write() wakes the process it wrote
    to, and a sampler then sees it "in" that write while it is only waiting for the CPU: the write
    sites looked twice as costly as perf's on-CPU count. Alone on its CPU it is not preempted.
    Yields the CPUs for wrk (None: fewer than 2 CPUs, nothing pinned).
    """
    if running.profile_pid is None:
        yield None
        return
    with alone([running.profile_pid], shared) as cpus:
        yield cpus


@contextlib.contextmanager
def alone(pids: list[int], shared: dict[str, list[int]]) -> Iterator[set[int] | None]:
    """`pids` on the last CPU, the `shared` processes on the others; yields the others (for wrk)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield None
        return
    mine, rest = {cpus[-1]}, set(cpus[:-1])
    others = [p for group in shared.values() for p in group if p not in pids]
    try:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, mine)
        for pid in others:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, rest)
        yield rest
    finally:
        for pid in [*pids, *others]:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, set(cpus))


def profile(running: Running, load: Load, seconds: float, out: Path, native: bool,
            cpus: set[int] | None) -> dict[str, Any] | None:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("profile: py-spy is not installed (pip install py-spy); skipped", file=sys.stderr)
        return None
    assert running.profile_pid is not None
    raw = out / "profile-gateway-1.txt"
    raw.unlink(missing_ok=True)
    spy_log = out / "py-spy.log"
    with spy_log.open("wb") as log:
        recorder = subprocess.Popen(
            [spy, "record", "--pid", str(running.profile_pid), "--duration", f"{seconds:g}", "--rate", "200",
             "--format", "raw", "--output", str(raw),
             # Not the default blocking mode: stopping the worker for each sample lands the samples
             # on system-call sites (a write looked 3x as costly as perf measures). --nonblocking
             # reads the stacks as the worker runs: innermost frames are exact, some stacks are cut
             # short. --native (C frames: uvloop, libc, the GC) cannot be nonblocking.
             *(["--native"] if native else ["--nonblocking"])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            time.sleep(0.5)
            result = wrk(running.url, load, seconds + 1, cpus)
            recorder.wait(30)
        finally:
            if recorder.poll() is None:
                os.killpg(recorder.pid, signal.SIGKILL)
                recorder.wait()
    if not raw.exists():
        print(f"profile: py-spy wrote nothing:\n{spy_log.read_text(errors='replace')}", file=sys.stderr)
        return None
    summary = breakdown(raw.read_text())
    summary["rps_while_profiled"] = result["requests"] / (result["duration_us"] / 1e6)
    summary["error_statuses_while_profiled"] = result["errors"]["status"]
    summary["mode"] = "Python and native frames, blocking" if native else "Python frames, nonblocking"
    summary["perf"] = perf_profile(running, load, seconds, out, cpus)
    summary["pinned"] = cpus is not None
    summary["raw"] = str(raw.relative_to(ROOT))
    return summary


def perf_profile(running: Running, load: Load, seconds: float, out: Path,
                 cpus: set[int] | None) -> dict[str, Any] | None:
    """The native side of the same worker with `perf record -e cpu-clock -g`, when perf works here."""
    if shutil.which("perf") is None:
        print("profile: perf not installed; native split skipped", file=sys.stderr)
        return None
    assert running.profile_pid is not None
    data = out / "perf-gateway-1.data"
    data.unlink(missing_ok=True)
    with (out / "perf.log").open("wb") as log:
        recorder = subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", "999", "-g", "-p", str(running.profile_pid),
             "-o", str(data), "--", "sleep", f"{seconds:g}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wrk(running.url, load, seconds + 1, cpus)
            recorder.wait(30)
        finally:
            if recorder.poll() is None:
                os.killpg(recorder.pid, signal.SIGKILL)
                recorder.wait()
    if recorder.returncode != 0 or not data.exists():
        print(f"profile: perf record failed:\n{(out / 'perf.log').read_text(errors='replace')}", file=sys.stderr)
        return None
    reports = []
    for mode in ("--no-children", "--children"):
        done = subprocess.run(
            ["perf", "report", "-i", str(data), mode, "--sort", "dso,sym", "--stdio", "-g", "none",
             "--percent-limit", "0"], capture_output=True, text=True, timeout=120, check=False,
        )
        reports.append(done.stdout)
    summary = perf_breakdown(*reports)
    summary["data"] = str(data.relative_to(ROOT))
    return summary


# --- report ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def version(args: list[str]) -> str:
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=10, check=False)
        except OSError:
            return "missing"
        return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "?"

    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    packages = {}
    for name in ("uvicorn", "uvloop", "httptools", "aiohttp", "hiredis", "starlette", "httpx", "redis"):
        try:
            packages[name] = pkg_version(name)
        except PackageNotFoundError:
            packages[name] = "missing"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "nginx": version([nginx_binary(), "-v"]),
        "wrk": version(["wrk", "-v"]),
        "redis": version([redis_binary(), "--version"]),
        "packages": packages,
    }


def git_describe() -> str:
    """The commit measured, and whether the gateway's code differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gateway", "lua"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes in gateway/ or lua/" if dirty else "")


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gw = results.get("gateway-1")
    if gw is None:
        return out
    if "naive" in results:
        value = gw["rps"] / results["naive"]["rps"]
        out["gateway-1/naive"] = {"value": value, "target": TARGET_NAIVE, "pass": value >= TARGET_NAIVE}
    if "peer" in results:
        value = gw["rps"] / results["peer"]["rps"]
        out["gateway-1/peer"] = {"value": value, "target": TARGET_PEER, "pass": value >= TARGET_PEER}
    if "nginx" in results:
        value = gw["rps"] / results["nginx"]["rps"]
        out["gateway-1/nginx"] = {"value": value, "target": TARGET_NGINX, "pass": value >= TARGET_NGINX}
    if "nginx-2" in results:
        out["gateway-1/nginx-2"] = {"value": gw["rps"] / results["nginx-2"]["rps"]}
    if "gateway-2" in results:
        out["gateway-2/gateway-1"] = {"value": results["gateway-2"]["rps"] / gw["rps"]}
    for name in COMPARISONS:  # the lean part's gain over the library's own, behind the same seam
        if name in results:
            out[f"gateway-1/{name}"] = {"value": gw["rps"] / results[name]["rps"]}
    if "floor" in results:  # CPU per request as a multiple of the floor's (less is better)
        floor = results["floor"]["proxy_cpu_us_per_request"]
        out["gateway-1 CPU/request / the floor's"] = {"value": gw["proxy_cpu_us_per_request"] / floor}
    return out


def low_load_ratios(low: dict[str, dict[str, dict[str, float]]], main_connections: int) -> dict[str, Any]:
    """The low-load bars: the 3-rule route's p50 at 1 connection over the no-limit route's, and a
    decision's own worker CPU (3-rule minus no-limit, per request) alone (1 connection) over batched
    (the main load)."""
    out: dict[str, Any] = {}
    limited = low.get("gateway, 3-rule route (1 worker)", {})
    open_ = low.get("gateway, a route with no limits (1 worker)", {})
    if "1" in limited and "1" in open_:
        value = limited["1"]["p50_ms"] / open_["1"]["p50_ms"]
        out["3-rule p50 / no-limit p50, 1 connection"] = {"value": value, "target": TARGET_LONE_P50,
                                                          "pass": value <= TARGET_LONE_P50, "at_most": True}
    unix_open, unix_limited = (low.get(label, {}) for label in UNIX_ROUTES)
    if "1" in unix_limited and "1" in unix_open:
        value = unix_limited["1"]["p50_ms"] / unix_open["1"]["p50_ms"]
        out["3-rule p50 / no-limit p50, 1 connection, Redis over a unix socket"] = {
            "value": value, "target": TARGET_LONE_P50, "pass": value <= TARGET_LONE_P50, "at_most": True}
    for routes, floor, name in (((limited, open_), ROUND_TRIP, "TCP"),
                                ((unix_limited, unix_open), ROUND_TRIP_UNIX, "unix socket")):
        bare = low.get(floor, {}).get("1")
        if bare and all("1" in r for r in routes):
            added = routes[0]["1"]["p50_ms"] - routes[1]["1"]["p50_ms"]
            out[f"p50 a decision adds / a bare round trip's, 1 connection, {name}"] = {
                "value": added / bare["p50_ms"], "added_us": added * 1000, "bare_us": bare["p50_ms"] * 1000}
    main = str(main_connections)
    if "1" in limited and "1" in open_ and main in limited and main in open_:
        lone = limited["1"]["cpu_us_per_request"] - open_["1"]["cpu_us_per_request"]
        batched = limited[main]["cpu_us_per_request"] - open_[main]["cpu_us_per_request"]
        value = lone / batched if batched > 0 else float("inf")
        out[f"decision CPU alone / batched ({main} connections)"] = {
            "value": value, "target": TARGET_LONE_CPU, "pass": value <= TARGET_LONE_CPU, "at_most": True,
            "lone_us": lone, "batched_us": batched}
        bare = low.get(ROUND_TRIP, {}).get("1")
        if bare and batched > 0:
            out[f"decision CPU alone, less a bare round trip's, / batched ({main} connections)"] = {
                "value": (lone - bare["cpu_us_per_request"]) / batched}
    return out


def low_load_markdown(report: dict[str, Any]) -> list[str]:
    low = report.get("low_load")
    if not low:
        return []
    counts = sorted({int(n) for rows in low.values() for n in rows} - {report["load"]["connections"]})
    lines = ["", f"Low load: wrk -t1 -c1 and -c8 --latency, {report.get('low_load_duration', 0):g}s each "
             "(server CPU: all its processes, per request).", "",
             "| at low load | " + " | ".join(f"p50 µs, {n} conn | p99 µs, {n} conn | CPU µs/request, {n} conn"
                                             for n in counts) + " |",
             "| --- | " + " | ".join("---: | ---: | ---:" for _ in counts) + " |"]
    for label, rows in low.items():
        cells = []
        for n in counts:
            r = rows.get(str(n))
            cells.append("- | - | -" if r is None else
                         f"{r['p50_ms'] * 1000:.0f} | {r['p99_ms'] * 1000:.0f} | {r['cpu_us_per_request']:.0f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    main = str(report["load"]["connections"])
    lines.append("")
    for label, rows in low.items():
        if main in rows:
            lines.append(f"- {label} at {main} connections: {rows[main]['cpu_us_per_request']:.0f} µs CPU/request, "
                         f"{rows[main]['rps']:,.0f} requests/s.")
    for r in report.get("ratios", {}).values():
        if "lone_us" in r:
            lines.append(f"- a decision's own worker CPU (3-rule route minus no-limit route, per request): "
                         f"{r['lone_us']:.0f} µs alone (1 connection), {r['batched_us']:.0f} µs batched "
                         f"({main} connections).")
    return lines


def markdown(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = [
        f"Run of {report['started']} UTC at commit {report['gateway_commit']}: `{report['command']}`, "
        f"wrk -t{report['load']['threads']} "
        f"-c{report['load']['connections']}, {report['load']['warmup']:g}s warm-up then "
        f"{report['load']['duration']:g}s measured per contender.",
        "",
        "| contender | requests/s | p50 ms | p99 ms | errors: status >= 400 / socket "
        "| proxy CPU µs/request | proxy reads, writes /request "
        "| CPU cores: proxy, wrk, upstream, redis, other | EVALSHA µs/call |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- | --- | ---: |",
    ]
    for name in CONTENDERS:
        r = results.get(name)
        if r is None:
            continue
        socket_errors = sum(r["socket_errors"].values())
        calls = r.get("redis_commands", {}).get("evalsha")
        evalsha = f"{calls['usec_per_call']:.1f}" if calls else "-"
        cpu = r["cpu_cores"]
        lines.append(
            f"| {LABELS[name]} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['error_statuses']} / {socket_errors} | {r['proxy_cpu_us_per_request']:.0f} | "
            f"{r['proxy_syscalls_per_request']['read']:.2f}, {r['proxy_syscalls_per_request']['write']:.2f} | "
            f"{cpu['proxy']:.2f}, {cpu['wrk']:.2f}, {cpu['upstream']:.2f}, {cpu['redis']:.2f}, "
            f"{cpu['other']:.2f} | {evalsha} |"
        )
    lines.append("")
    for name in CONTENDERS:
        attempts = results.get(name, {}).get("attempts", [])
        if len(attempts) > 1:
            text = "; ".join(f"{a['rps']:,.0f} req/s with {a['other']:.2f} cores of other work" for a in attempts)
            lines.append(f"- {name} was measured twice (other work on the machine during the first): {text}; "
                         "the quieter is shown.")
    for name in ("gateway-1", "gateway-2"):
        outcomes = results.get(name, {}).get("gateway_outcomes")
        if outcomes:
            text = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(outcomes.items()))
            lines.append(f"- {name} `/metrics` (warm-up + measured run): {text}")
    lines.append("")
    lines.append("| ratio | value | target | result |")
    lines.append("| --- | ---: | ---: | --- |")
    for key, r in report["ratios"].items():
        target = f"{'<=' if r.get('at_most') else '>='} {r['target']:g}" if "target" in r else "(reference)"
        verdict = ("**PASS**" if r["pass"] else "**FAIL**") if "pass" in r else ""
        lines.append(f"| {key} | {r['value']:.2f} | {target} | {verdict} |")
    lines += low_load_markdown(report)
    m = report["machine"]
    lines += [
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), Linux {m['kernel']}, Python {m['python']}; "
        f"{m['nginx']}; {m['wrk'].split(' Copyright')[0]}; {m['redis'].split(' sha=')[0]}; "
        f"load average before the run {m['load_average_before']}.",
        "Packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()) + ".",
    ]
    prof = report.get("profile")
    if prof:
        lines += ["", f"Profile of the gateway (1 worker) under the same load: py-spy, 200 Hz, "
                  f"{prof['mode']}, {prof['samples']:,} samples ({prof['rps_while_profiled']:,.0f} "
                  f"requests/s and {prof['error_statuses_while_profiled']} error statuses while sampled); "
                  f"raw stacks in `{prof['raw']}`.", "", render_breakdown(prof)]
        if prof.get("perf"):
            lines += ["", f"The native side of the same worker: `perf record -e cpu-clock -F 999 -g`, "
                      f"`{prof['perf']['data']}`.", "", render_perf(prof["perf"])]
    return "\n".join(lines)


def write_doc_block(begin: str, end: str, heading: str, command: str, how: str, lines: list[str]) -> None:
    """Put a bench's generated block (between `begin` and `end`) into docs/benchmarks.md: in place
    of the last one, or at the end under `heading` the first time."""
    text = DOCS.read_text()
    block = "\n".join([begin, f"Measured {dt.date.today().isoformat()} on this 2-core VM with `{command}` "
                               f"({how}; {git_describe()}):", "", *lines, end])
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    DOCS.write_text(text)


def update_docs(block: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else f"# Benchmarks\n\n{DOC_START}\n{DOC_END}\n"
    if DOC_START not in text or DOC_END not in text:
        text = text.rstrip() + f"\n\n{DOC_START}\n{DOC_END}\n"
    head, rest = text.split(DOC_START, 1)
    _, tail = rest.split(DOC_END, 1)
    DOCS.write_text(f"{head}{DOC_START}\n{block}\n{DOC_END}{tail}")


def print_table(report: dict[str, Any]) -> None:
    results = report["results"]
    print()
    print(f"{'contender':<46} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'err>=400':>9} {'sock err':>8} "
          f"{'proxy CPU':>9} {'µs/req':>7} {'other CPU':>9}")
    for name in CONTENDERS:
        r = results.get(name)
        if r is None:
            continue
        print(f"{LABELS[name]:<46} {r['rps']:>9,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['error_statuses']:>9} {sum(r['socket_errors'].values()):>8} {r['cpu_cores']['proxy']:>9.2f} "
              f"{r['proxy_cpu_us_per_request']:>7.0f} {r['cpu_cores']['other']:>9.2f}")
    for name in ("gateway-1", "gateway-2"):
        outcomes = results.get(name, {}).get("gateway_outcomes")
        if outcomes:
            print(f"  {name} outcomes: " + ", ".join(f"{k}={v:,.0f}" for k, v in sorted(outcomes.items())))
    print()
    for key, r in report["ratios"].items():
        verdict = ("PASS" if r["pass"] else "FAIL") if "pass" in r else "(reference)"
        target = f"target {'<=' if r.get('at_most') else '>='} {r['target']:g}" if "target" in r else ""
        print(f"{key:<22} {r['value']:>7.2f}  {target:<16} {verdict}")
    for line in low_load_markdown(report):
        print(line)
    if report.get("profile"):
        print()
        print(render_breakdown(report["profile"], markdown=False))
        if report["profile"].get("perf"):
            print(render_perf(report["profile"]["perf"], markdown=False))


# --- main -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run through the finally blocks, like Ctrl-C."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per contender (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per contender (2)")
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CONTENDERS)}")
    parser.add_argument("--no-profile", action="store_true", help="skip the profile (py-spy, perf) of gateway-1")
    parser.add_argument("--profile-seconds", type=float, default=10.0, help="seconds of each profiler (10)")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames too (uvloop, libc)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: print and render a saved run (bench/out/*.json), rewriting "
                             "the docs block unless --no-docs")
    parser.add_argument("--low-load", default="1,8", help="connections of the low-load table ('' for none)")
    parser.add_argument("--low-load-duration", type=float, default=5.0, help="seconds per low-load cell (5)")
    parser.add_argument("--max-other", type=float, default=0.3,
                        help="CPU cores busy with other work above which a measurement is taken again, "
                             "once, keeping the quieter of the two (0.3)")
    args = parser.parse_args(argv)
    if args.from_json:
        saved: dict[str, Any] = json.loads(Path(args.from_json).read_text())
        print_table(saved)
        if not args.no_docs:
            update_docs(markdown(saved))
            print(f"updated the generated block of {DOCS.relative_to(ROOT)}")
        return 0

    chosen = [c.strip() for c in args.only.split(",") if c.strip()] or list(CONTENDERS)
    unknown = set(chosen) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contender(s) {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (make system-deps, or apt-get install wrk)")
    load = Load(args.threads, args.connections, args.duration, args.warmup)
    OUT.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    report: dict[str, Any] = {
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["bench/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "gateway_commit": git_describe(),
        "load": vars(load),
        "machine": machine(),
        "results": {},
        "low_load": {},
        "low_load_duration": args.low_load_duration,
    }
    low_counts = [int(n) for n in args.low_load.split(",") if n.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    procs = Processes(tmp)
    try:
        with terminated_as_interrupt():
            upstream_port, redis_port = free_port(), free_port()
            upstream = start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1,
                                   upstream_server(upstream_port))
            redis = start_redis(procs, tmp / "redis", redis_port)
            shared = {"upstream": descendants(upstream.pid), "redis": [redis.pid]}
            if low_counts:
                print("== low load: the upstream direct", flush=True)
                direct = Running(f"http://127.0.0.1:{upstream_port}", upstream)
                label = next(iter(LOW_LOAD))
                report["low_load"][label] = low_load(direct, label, "", low_counts, args.low_load_duration,
                                                     load, {"redis": [redis.pid]}, redis_port)
                for label, url in ((ROUND_TRIP, f"redis://127.0.0.1:{redis_port}"),
                                   (ROUND_TRIP_UNIX, f"unix://{tmp / 'redis' / 'redis.sock'}")):
                    wait_quiet(0.3, longest=5)
                    found = round_trips(url, args.low_load_duration, redis.pid)
                    report["low_load"][label] = {"1": found}
                    print(f"   {label}: p50 {found['p50_ms'] * 1000:.0f} µs, p99 {found['p99_ms'] * 1000:.0f} µs, "
                          f"{found['cpu_us_per_request']:.0f} µs CPU/call", flush=True)
            for name in CONTENDERS:
                if name not in chosen:
                    continue
                print(f"== {LABELS[name]}", flush=True)
                running = start_contender(name, procs, tmp, upstream_port, redis_port)
                try:
                    background = wait_quiet(args.max_other)
                    result = measure(running, load, shared, redis_port)
                    attempts = [{"rps": result["rps"], "other": result["cpu_cores"]["other"],
                                 "background_before": background}]
                    if result["cpu_cores"]["other"] > args.max_other:
                        print(f"   disturbed: {result['cpu_cores']['other']:.2f} cores busy with other work "
                              f"({result['rps']:,.0f} req/s); measuring again", flush=True)
                        background = wait_quiet(args.max_other)
                        again = measure(running, load, shared, redis_port)
                        attempts.append({"rps": again["rps"], "other": again["cpu_cores"]["other"],
                                         "background_before": background})
                        if again["cpu_cores"]["other"] < result["cpu_cores"]["other"]:
                            result = again
                    result["attempts"] = attempts
                    result.update(running.notes)
                    if running.metrics_url:
                        result["gateway_outcomes"] = gateway_outcomes(running.metrics_url)
                    report["results"][name] = result
                    print(f"   {result['rps']:,.0f} req/s, p99 {result['p99_ms']:.2f} ms, "
                          f"{result['error_statuses']} error statuses, socket errors {result['socket_errors']}",
                          flush=True)
                    for label, (serving, prefix) in LOW_LOAD.items():
                        if serving == name and low_counts:
                            report["low_load"][label] = low_load(running, label, prefix, low_counts,
                                                                 args.low_load_duration, load, shared, redis_port)
                    if name == "gateway-1" and low_counts:
                        print("== the same gateway, Redis over a unix socket (low load)", flush=True)
                        unix = start_contender(name, procs, tmp, upstream_port, redis_port,
                                               f"unix://{tmp / 'redis' / 'redis.sock'}")
                        try:
                            for label, prefix in UNIX_ROUTES.items():
                                report["low_load"][label] = low_load(
                                    Running(unix.url, unix.process), label, prefix, low_counts,
                                    args.low_load_duration, load, shared, redis_port)
                        finally:
                            procs.stop(unix.process)
                    if name == "gateway-1" and not args.no_profile:
                        print("== profiling gateway-1 (alone on one CPU): py-spy, then perf", flush=True)
                        with worker_alone(running, shared) as cpus:
                            report["profile"] = profile(running, load, args.profile_seconds, OUT, args.native, cpus)
                finally:
                    procs.stop(running.process)
    except KeyboardInterrupt:
        print("interrupted: stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    report["ratios"] = {**ratios(report["results"]), **low_load_ratios(report["low_load"], load.connections)}
    report["finished"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    stamp = started.strftime("%Y%m%dT%H%M%S")
    for path in (OUT / f"results-{stamp}.json", OUT / "latest.json"):
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    block = markdown(report)
    (OUT / "latest.md").write_text(block + "\n")
    print(f"\nJSON: {(OUT / 'latest.json').relative_to(ROOT)}; markdown: {(OUT / 'latest.md').relative_to(ROOT)}")
    if not args.only and not args.no_docs:
        update_docs(block)
        print(f"updated the generated block of {DOCS.relative_to(ROOT)}")
    failed = [k for k, r in report["ratios"].items() if r.get("pass") is False]
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
