#!/usr/bin/env python3
"""The gateway worker's CPU per request at two revisions, side by side in one run, beside the
Python floor: `python bench/before_after.py BEFORE [AFTER] [--docs]` (AFTER: the working tree).

Each revision is checked out into a temporary git worktree and served from it (PYTHONPATH), with
bench/run.py's 3-rule route, one worker, the same Redis and nginx upstream; the proxy port and the
check port (bench/check.lua) are measured at 50 connections, the revisions in turn, `--rounds`
times, and the median of each is reported with its multiple of the floor (bench/floor_server.py,
measured in the same rounds). CPU is read from /proc (bench/run.py), so the machine's other load
moves all rows alike; compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import check  # noqa: E402  (bench/check.py: the check port's wrk run and its gateway)
import run  # noqa: E402  (bench/run.py: processes, nginx, wrk, CPU readings)

BEGIN, END = "<!-- bench/before_after.py: begin -->", "<!-- bench/before_after.py: end -->"
DOORS = ("proxy port", "check port")


def worktree(revision: str, under: Path) -> Path:
    path = under / revision.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision], check=True,
                   capture_output=True)
    return path


def measure(trees: dict[str, Path], duration: float, rounds: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-before-after-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "logs").mkdir()
        procs = run.Processes(tmp / "logs")
        saved = os.environ.get("PYTHONPATH")
        try:
            upstream_port, redis_port = run.free_port(), run.free_port()
            run.start_nginx(procs, "upstream", tmp / "upstream", upstream_port, 1, run.upstream_server(upstream_port))
            run.start_redis(procs, tmp, redis_port)
            floor = run.start_contender("floor", procs, tmp, upstream_port, redis_port)
            for _ in range(rounds):
                cpu = check.measure(floor.url, 50, duration, [floor.process.pid])["gateway_cpu_us_per_request"]
                found.setdefault("floor", []).append(cpu)
                for label, tree in trees.items():
                    os.environ["PYTHONPATH"] = str(tree)
                    check_port = run.free_port()
                    gateway = check.start_gateway(procs, tmp, upstream_port, redis_port, check_port)
                    worker = gateway.notes["worker_pids"]
                    proxied = check.measure(gateway.url, 50, duration, worker)
                    checked = check.measure(f"http://127.0.0.1:{check_port}", 50, duration, worker, check.CHECK_SCRIPT)
                    found.setdefault(f"{label}|proxy port", []).append(proxied["gateway_cpu_us_per_request"])
                    found.setdefault(f"{label}|check port", []).append(checked["gateway_cpu_us_per_request"])
                    procs.stop(gateway.process)
        finally:
            procs.stop_all()
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    return found


def table(found: dict[str, list[float]], labels: list[str]) -> list[str]:
    floor = statistics.median(found["floor"])
    lines = ["| worker CPU per request, 50 connections | " + " | ".join(labels) + " | after / before |",
             "| --- |" + " ---: |" * (len(labels) + 1)]
    for door in DOORS:
        medians = [statistics.median(found[f"{label}|{door}"]) for label in labels]
        cells = [f"{m:.1f} µs ({m / floor:.1f}x the floor)" for m in medians]
        lines.append(f"| {door} | " + " | ".join(cells) + f" | {medians[-1] / medians[0]:.2f} |")
    lines += ["", f"The floor (bare uvloop + httptools, an empty 200): {floor:.1f} µs. Runs of each: "
              + "; ".join(f"{key}: {', '.join(f'{v:.0f}' for v in values)}" for key, values in found.items()) + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a git revision")
    parser.add_argument("after", nargs="?", default="", help="a git revision (default: the working tree)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measured run (5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the revisions in turn (3)")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as trees_dir:
        under = Path(trees_dir)
        trees: dict[str, Path] = {args.before: worktree(args.before, under)}
        trees[args.after or "working tree"] = worktree(args.after, under) if args.after else ROOT
        try:
            found = measure(trees, args.duration, args.rounds)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    lines = table(found, list(trees))
    print("\n".join(lines))
    if args.docs:
        command = f"python bench/before_after.py {args.before} {args.after}".rstrip()
        run.write_doc_block(BEGIN, END, "One core for four doors: the worker's CPU before and after",
                            command + " --docs", "wrk -t2 -c50", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
