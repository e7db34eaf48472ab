#!/usr/bin/env python3
"""What traces cost: the gateway's CPU per request with tracing off, on (every request a span, its
decision's and its upstream exchange's spans, exported over OTLP/HTTP to a receiver here), on with
one request in ten sampled, and, for the claim that off costs nothing, the code before traces
existed (`--before COMMIT`).

    python bench/tracing.py [--before COMMIT] [--duration 10] [--rounds 2]

Same upstream (nginx), same Redis, same load (wrk -t2 -c50) and the 3-rule route of bench/run.py,
one gateway worker; the contenders take turns, `--rounds` times, so a machine whose load drifts
disturbs each alike. The receiver counts the spans it is sent (the SDK's batch processor drops
spans when its queue is full: spans per request says whether it did).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: processes, load, measurement)


class Sink:
    """An OTLP/HTTP trace receiver that counts spans and keeps nothing."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest.FromString(body)
                sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", run.free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def source_of(commit: str, tmp: Path) -> Path:
    """The package as it was at `commit`, unpacked (git archive) for PYTHONPATH."""
    where = tmp / f"src-{commit[:12]}"
    where.mkdir()
    archive = subprocess.run(["git", "-C", str(BENCH.parent), "archive", commit, "gateway", "lua"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def start(name: str, procs: run.Processes, tmp: Path, upstream_port: int, redis_port: int,
          env: dict[str, str], source: Path | None) -> run.Running:
    saved = dict(os.environ)
    os.environ.update(env)
    if source is not None:
        os.environ["PYTHONPATH"] = str(source)
    try:
        return run.start_contender(name, procs, tmp, upstream_port, redis_port)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="", help="a commit before traces, measured as 'before'")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-tracing-"))
    procs = run.Processes(tmp)
    sink = Sink()
    load = run.Load(threads=2, connections=50, duration=args.duration, warmup=args.warmup)
    contenders: dict[str, tuple[dict[str, str], Path | None]] = {}
    if args.before:
        contenders["before"] = ({}, source_of(args.before, tmp))
    contenders["off"] = ({}, None)
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_SERVICE_NAME": "bench"}
    contenders["on"] = (on, None)
    # the lever for a busy gateway: a trace for one request in ten (a client's sampled traceparent wins)
    contenders["on-10%"] = (on | {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
                            None)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    try:
        upstream_port, redis_port = run.free_port(), run.free_port()
        upstream = run.start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1,
                                   run.upstream_server(upstream_port))
        redis = run.start_redis(procs, tmp / "redis", redis_port)
        shared = {"upstream": run.descendants(upstream.pid), "redis": [redis.pid]}
        for round_ in range(args.rounds):
            for label, (env, source) in contenders.items():
                running = start(f"gateway-1-{label}-{round_}", procs, tmp, upstream_port, redis_port, env, source)
                try:
                    spans_before = sink.spans
                    found = run.measure(running, load, shared, redis_port)
                    assert running.metrics_url is not None
                    served = sum(v for k, v in run.gateway_outcomes(running.metrics_url).items()
                                 if k not in ("refused_locally", "rule_refusals", "redis_errors"))
                finally:
                    procs.stop(running.process)  # a drained worker exports what its queue held
                spans = (sink.spans - spans_before) / max(1.0, served)  # the warm-up's requests too
                results[label].append({"rps": found["rps"], "cpu_us": found["proxy_cpu_us_per_request"],
                                       "p99_ms": found["p99_ms"], "errors": found["error_statuses"],
                                       "other": found["cpu_cores"]["other"], "spans_per_request": spans})
                print(f"round {round_ + 1} {label:7}: {found['rps']:7,.0f} req/s, "
                      f"{found['proxy_cpu_us_per_request']:6.0f} µs CPU/request, p99 {found['p99_ms']:.2f} ms, "
                      f"{found['error_statuses']} error statuses, other work {found['cpu_cores']['other']:.2f} "
                      f"cores, {spans:.2f} spans/request", flush=True)
    finally:
        procs.stop_all()
        sink.server.shutdown()
    base = sum(r["cpu_us"] for r in results["off"]) / len(results["off"])
    for label, rows in results.items():
        mean = sum(r["cpu_us"] for r in rows) / len(rows)
        print(f"{label:7}: {mean:6.0f} µs CPU/request, {mean / base:.2f}x off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
