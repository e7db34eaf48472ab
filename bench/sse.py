#!/usr/bin/env python3
"""A 10 MB Server-Sent Events answer through the gateway, with and without a token budget, side by
side in one run: `python bench/sse.py` (`make bench` runs it). The bar (issue 31): the settle reader
(gateway/usage.py) costs at most 15% of the worker's CPU over plain streaming.

The upstream is nginx serving a 10 MB file of OpenAI-style chunks (`"usage": null` in each, ~100
bytes apiece, the usage in the last), as `text/event-stream`. The gateway (1 worker) has two routes
to it: /plain without limits, /budget with a token budget (`settle: response_json:usage.total_tokens`,
its reserve the default: a GET has no body). wrk -t1 -c1 downloads each for the same time; MB/s and
the worker's CPU per MB are read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import run  # noqa: E402  (bench/run.py: processes, nginx, CPU readings)

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/sse.py: begin -->", "<!-- bench/sse.py: end -->"
SIZE = 10 * 1024 * 1024
TARGET_OVERHEAD = 0.15

CONFIG = """\
version: 1
redis: {{timeout: 200ms}}
upstreams: {{llm: {{url: "http://127.0.0.1:{upstream_port}", timeout: 60s}}}}
routes:
  - name: plain
    match: {{path: /plain}}
    upstream: llm
  - name: limited
    match: {{path: /limited}}
    upstream: llm
    limits:
      - {{name: calls, by: [], algorithm: token_bucket, rate: 1000000000/s, burst: 1000000000}}
  - name: budget
    match: {{path: /budget}}
    upstream: llm
    limits:
      - {{name: tokens, by: [], algorithm: token_bucket, rate: 1000000000/s, burst: 1000000000,
         cost: {{reserve: "request_json:max_tokens", default: 100, settle: "response_json:usage.total_tokens"}}}}
"""


def sse_file(path: Path) -> None:
    chunks = []
    size, n = 0, 0
    while size < SIZE:
        event = b"data: " + json.dumps({"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                                         "choices": [{"index": 0, "delta": {"content": f"w{n % 97}"}}],
                                         "usage": None}).encode() + b"\n\n"
        chunks.append(event)
        size += len(event)
        n += 1
    chunks.append(b"data: " + json.dumps({"choices": [], "usage": {"total_tokens": n}}).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    path.write_bytes(b"".join(chunks))


def upstream_server(port: int, root: Path) -> str:
    return textwrap.dedent(f"""\
        server {{
            listen 127.0.0.1:{port} backlog=4096;
            location / {{
                default_type text/event-stream;
                root {root};
                try_files /sse.txt =404;
            }}
        }}
        """)


def measure(url: str, duration: float, pids: list[int]) -> dict[str, Any]:
    subprocess.run(["wrk", "-t1", "-c1", "-d1s", url], capture_output=True, timeout=60, check=True)  # warm-up
    before = run.cpu_seconds(pids)
    done = subprocess.run(["wrk", "-t1", "-c1", f"-d{max(1, round(duration))}s", "--timeout", "30s", url],
                          capture_output=True, text=True, timeout=duration + 60, check=True)
    spent = run.cpu_seconds(pids) - before
    found = re.search(r"(\d+) requests in ([\d.]+)s", done.stdout)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    if found is None or int(found.group(1)) == 0:
        raise RuntimeError(f"wrk completed no answer from {url}:\n{done.stdout}")
    requests, seconds = int(found.group(1)), float(found.group(2))
    megabytes = requests * SIZE / 1e6
    return {"requests": requests, "mb_per_s": round(megabytes / seconds, 1),
            "cpu_ms_per_mb": round(spent / megabytes * 1000, 2) if megabytes else None,
            "errors": int(errors.group(1)) if errors else 0}


def settled(metrics_url: str) -> float:
    _, body = run.http_get(metrics_url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("gateway_settlements_total{") and 'route="budget"' in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-sse-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "logs").mkdir()
        (tmp / "www").mkdir()
        sse_file(tmp / "www" / "sse.txt")
        procs = run.Processes(tmp / "logs")
        try:
            upstream_port, redis_port, port, admin_port = (run.free_port() for _ in range(4))
            run.start_nginx(procs, "upstream", tmp / "nginx", upstream_port, 1, upstream_server(upstream_port,
                                                                                                tmp / "www"))
            run.start_redis(procs, tmp, redis_port)
            config = tmp / "routes.yaml"
            config.write_text(CONFIG.format(upstream_port=upstream_port))
            env = dict(os.environ, GATEWAY_LOG_LEVEL="warning")
            gateway = procs.start("gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                              "--host", "127.0.0.1", "--port", str(port), "--admin-port",
                                              str(admin_port), "--redis-url", f"redis://127.0.0.1:{redis_port}"],
                                  env=env, cwd=tmp)
            admin = f"http://127.0.0.1:{admin_port}"
            run.wait_for(lambda: run.http_get(admin + "/readyz")[0] == 200, "/readyz 200", gateway, procs, "gateway")
            workers = [p for p in run.descendants(gateway.pid) if "spawn_main" in run.cmdline(p)]
            rows: dict[str, dict[str, Any]] = {}
            for _ in range(2):  # alternated, twice: the machine's speed drifts
                for name in ("plain", "limited", "budget"):
                    result = measure(f"http://127.0.0.1:{port}/{name}", args.duration / 2, workers)
                    previous = rows.get(name)
                    if previous is not None:
                        result = {k: (previous[k] + result[k]) / 2 if k != "requests" else previous[k] + result[k]
                                  for k in result}
                    rows[name] = result
            rows["budget"]["settlements"] = settled(admin + "/metrics")
        finally:
            procs.stop_all()
    overhead = rows["budget"]["cpu_ms_per_mb"] / rows["plain"]["cpu_ms_per_mb"] - 1
    reader = (rows["budget"]["cpu_ms_per_mb"] - rows["limited"]["cpu_ms_per_mb"]) / rows["plain"]["cpu_ms_per_mb"]
    lines = ["| route | MB/s | worker CPU per MB | answers |", "| --- | ---: | ---: | ---: |"]
    for name, label in (("plain", "no limit (plain streaming)"),
                        ("limited", "a limit that does not read the answer (a decision per answer)"),
                        ("budget", "a token budget reading the stream (a decision and a settlement per answer)")):
        r = rows[name]
        lines.append(f"| {label} | {r['mb_per_s']:.1f} | {r['cpu_ms_per_mb']:.2f} ms | {r['requests']:.0f} |")
    lines += ["", f"Worker CPU per MB over plain streaming: the settle reader alone (the budget against the "
              f"limit that does not read the answer) **{reader:+.0%}** (the bar: at most +{TARGET_OVERHEAD:.0%}); "
              f"the whole token budget, its decision and settlement included, {overhead:+.0%}. Settlements "
              f"sent: {rows['budget']['settlements']:.0f}."]
    print("\n".join(lines))
    if args.docs:
        run.write_doc_block(BEGIN, END, "Token budgets: reading a stream's usage",
                            "python bench/sse.py --docs", "a 10 MB answer, wrk -t1 -c1", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
