"""Split py-spy's raw (collapsed) stacks of a gateway worker into the areas of a request's life.

Each sample is charged to ONE area: walking from the innermost frame outwards, the first frame
whose file belongs to a known area decides. Frames of the standard library (asyncio, logging,
json, re, ...) are transparent, so `json.dumps` called from the app is app time and a future
resolved inside the Redis client is Redis-client time. Samples with no known frame at all are the
event loop itself (uvloop's Python-visible glue, callbacks, task steps).

    python bench/profile_areas.py bench/out/profile-gateway-1.txt
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

# (area, file patterns) in priority order for one frame; the first area that matches a frame wins.
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics (prometheus_client)", ("prometheus_client/", "gateway/metrics.py")),
    ("Redis client (redis-py + hiredis, gateway/redis/ batching)", (
        "redis/", "gateway/scripts.py", "hiredis",
    )),
    ("httpx models (Request, Headers, Response)", ("httpx/",)),
    ("upstream transport (gateway/http/transport.py; httpcore, h11, h2)", (
        "gateway/http/transport.py", "httpcore/", "h11/", "h2/",
    )),
    ("forwarding (gateway/proxy.py)", ("gateway/proxy.py",)),
    ("Starlette (application, middleware, router and its routes)", ("starlette/",)),
    ("server protocol (gateway/http/server.py on httptools; uvicorn)", (
        "uvicorn/", "httptools/", "gateway/http/server.py", "gateway/http/exchange.py",
        "gateway/http/flow_control.py", "gateway/http/early.py",
    )),
    ("request checks (gateway/http/request.py)", ("gateway/http/request.py",)),
    ("gateway app code (match, identity, pipeline, limiter, responses)", ("gateway/",)),
)
# Native frames (py-spy --native) that are an area of their own wherever they are on the stack.
GC_FUNCTIONS = frozenset({"gc_collect_main", "gc_collect_with_callback", "gc_collect_generations"})
GC = "garbage collector (cyclic GC passes)"
SYSCALLS = frozenset({
    "write", "writev", "read", "readv", "send", "sendmsg", "sendto", "recv", "recvmsg", "recvfrom",
    "epoll_wait", "epoll_ctl", "getpid", "clock_gettime", "futex",
})
OTHER = "event loop (uvloop: epoll, socket reads, callbacks) and other"
ROOT_FILE = "gateway/supervisor.py"  # worker_main: the bottom of every stack, so left out of the file list
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(frame: str) -> tuple[str, str]:
    m = FRAME.match(frame.strip())
    if m is None:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


# The bottom of every stack (process start, uvicorn's Server.run, asyncio.run): transparent, or all
# of the event loop's own work (epoll, socket reads) would be charged to uvicorn or the supervisor.
BOTTOM = ("uvicorn/server.py", "uvicorn/_compat.py", "uvicorn/main.py", "gateway/supervisor.py")


# py-spy names files of a sub-package by their bare name: these are the gateway's.
BARE = {name: f"gateway/http/{name}" for name in ("server.py", "transport.py", "request.py")}


def area_of(file: str) -> str | None:
    file = BARE.get(file, file)
    if file.startswith(BOTTOM):
        return None
    for area, patterns in AREAS:
        if any(p in file for p in patterns):
            return area
    return None


def short(file: str) -> str:
    """site-packages/aiohttp/client.py -> aiohttp/client.py; /x/repo/gateway/app.py -> gateway/app.py."""
    for marker in ("site-packages/", "dist-packages/", "/lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
    if "/gateway/" in file:
        file = "gateway/" + file.split("/gateway/", 1)[1]
    return file


def breakdown(raw: str, top: int = 15) -> dict[str, Any]:
    """The samples by area, the hottest functions by self time, and gateway files inclusive."""
    areas: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    gateway_files: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        line = line.strip()
        if not line or " " not in line:
            continue
        stack_text, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [parse_frame(f) for f in stack_text.split(";")]
        frames = [(func, short(file)) for func, file in frames if file]  # drop process/thread labels
        if not frames:
            continue
        total += count
        if any(func in GC_FUNCTIONS for func, _ in frames):
            area = GC
        else:
            area = next((a for a in (area_of(f) for _, f in reversed(frames)) if a is not None), OTHER)
        areas[area] += count
        func, file = frames[-1]
        if func in SYSCALLS and ".so" in file:  # a libc wrapper: the thread is in the kernel
            syscalls[func] += count
        self_time[f"{func} ({file})"] += count
        seen: set[str] = set()
        for func, file in frames:
            name = f"{func} ({file})"
            if name not in seen:
                seen.add(name)
                inclusive[name] += count
            if file.startswith("gateway/") and file != ROOT_FILE and file not in seen:
                seen.add(file)
                gateway_files[file] += count

    def pct(n: int) -> float:
        return round(100.0 * n / total, 1) if total else 0.0

    return {
        "samples": total,
        "areas": [(a, pct(n)) for a, n in areas.most_common()],
        "self": [(f, pct(n)) for f, n in self_time.most_common(top)],
        "gateway_self": [(f, pct(n)) for f, n in self_time.most_common() if "(gateway/" in f][:top],
        "inclusive": [(f, pct(n)) for f, n in inclusive.most_common(top * 2)],
        "gateway_files_inclusive": [(f, pct(n)) for f, n in gateway_files.most_common()],
        "syscalls": [(f, pct(n)) for f, n in syscalls.most_common()],  # native profiles only
    }


# --- perf: the native side (kernel, interpreter, garbage collector, C extensions) -------------

PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+(?:([\d.]+)%\s+)?(\S+)\s+\[([.k])\]\s+(.+?)\s*$")
SYSCALL_PATHS = {  # kernel entry points -> what the process asked for (inclusive of the kernel work)
    "ksys_write": "write/writev (loopback TCP: includes delivering to the receiver)",
    "ksys_read": "read",
    "__x64_sys_epoll_pwait": "epoll_wait",
    "__x64_sys_epoll_wait": "epoll_wait",
    "__sys_sendto": "sendto",
    "__sys_recvfrom": "recvfrom",
    "__x64_sys_getpid": "getpid",
}


def perf_lines(text: str) -> list[tuple[float, float | None, str, str, str]]:
    """`perf report --stdio -g none --sort dso,sym` rows: (self or children %, self %, dso, k/., symbol)."""
    rows = []
    for line in text.splitlines():
        m = PERF_LINE.match(line)
        if m:
            second = float(m.group(2)) if m.group(2) else None
            rows.append((float(m.group(1)), second, m.group(3), m.group(4), m.group(5)))
    return rows


def is_gc_collection(symbol: str) -> bool:
    return (symbol in GC_FUNCTIONS or symbol.startswith("visit_") or "traverse" in symbol
            or symbol.startswith("invoke_gc_callback"))


def most_common(shares: dict[str, float]) -> list[tuple[str, float]]:
    """`Counter.most_common()` for float values: descending, ties kept in insertion order."""
    return sorted(shares.items(), key=lambda item: item[1], reverse=True)


def perf_breakdown(self_report: str, children_report: str) -> dict[str, Any]:
    """Native split of a worker's CPU from `perf record -g`: by DSO, GC collection, system calls."""
    # Percentages are floats, and typeshed's Counter holds ints: a float defaultdict, ordered below
    # exactly as Counter.most_common() would (descending, ties in insertion order).
    areas: defaultdict[str, float] = defaultdict(float)
    for pct_self, _, dso, kind, symbol in perf_lines(self_report):
        if kind == "k":
            areas["kernel (system calls, loopback TCP, scheduler)"] += pct_self
        elif is_gc_collection(symbol):
            areas["garbage collector (collections: gc_collect_main, visit_*, *_traverse)"] += pct_self
        elif dso.startswith("libpython"):
            areas["interpreter (libpython: bytecode, objects, allocation)"] += pct_self
        elif dso.startswith("loop.cpython"):
            areas["uvloop (event loop, transports)"] += pct_self
        elif dso.startswith("libc"):
            areas["libc (malloc, memcpy)"] += pct_self
        else:
            areas["other C extensions (httptools, aiohttp/multidict/yarl, hiredis, _asyncio)"] += pct_self
    syscalls: defaultdict[str, float] = defaultdict(float)
    for children, _, _, kind, symbol in perf_lines(children_report):
        if kind == "k" and symbol in SYSCALL_PATHS:
            syscalls[SYSCALL_PATHS[symbol]] += children
    return {
        "areas": [(a, round(p, 1)) for a, p in most_common(areas)],
        "syscalls": [(a, round(p, 1)) for a, p in most_common(syscalls)],
    }


def render_perf(summary: dict[str, Any], markdown: bool = True) -> str:
    out: list[str] = []
    for title, key in (("CPU by native area (perf, self time)", "areas"),
                       ("System calls, inclusive of the kernel work they cause (perf)", "syscalls")):
        rows = summary.get(key) or []
        if markdown:
            out += [f"**{title}**", "", "| % of CPU samples | where |", "| ---: | --- |"]
            out += [f"| {p:.1f} | {name} |" for name, p in rows]
            out.append("")
        else:
            out.append(title + ":")
            out += [f"  {p:5.1f}%  {name}" for name, p in rows]
    return "\n".join(out).rstrip()


def render_breakdown(summary: dict[str, Any], markdown: bool = True) -> str:
    sections = (
        ("Samples by area (innermost known frame decides)", "areas"),
        ("Hottest functions, self time", "self"),
        ("Gateway functions, self time", "gateway_self"),
        ("System calls, self time (py-spy --native only)", "syscalls"),
    )
    out: list[str] = []
    for title, key in sections:
        rows = summary.get(key) or []
        if not rows:
            continue
        if markdown:
            out += [f"**{title}**", "", "| % of samples | where |", "| ---: | --- |"]
            out += [f"| {p:.1f} | `{name}` |" for name, p in rows]
            out.append("")
        else:
            out.append(title + ":")
            out += [f"  {p:5.1f}%  {name}" for name, p in rows]
    return "\n".join(out).rstrip()


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    summary = breakdown(Path(sys.argv[1]).read_text())
    print(f"{summary['samples']} samples")
    print(render_breakdown(summary, markdown=False))
    inclusive = summary["inclusive"]
    print("Inclusive (anywhere on the stack):")
    for name, p in inclusive:
        print(f"  {p:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
