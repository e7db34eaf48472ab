"""Open-loop load for the protect tests and bench/protect.py: requests sent at a fixed rate whatever
becomes of the ones before (as users who do not wait for each other), each recorded with its
priority, status and answer time; and the capacity upstream's goodput sampled as it goes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Sent:
    at: float                 # seconds since the load started
    priority: str
    status: int               # 0: no answer (the connection failed or timed out)
    seconds: float
    retry_after: str | None


@dataclass(frozen=True)
class Stream:
    priority: str
    rate: float               # requests a second
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    served: list[tuple[float, int]] = field(default_factory=list)  # (at, the upstream's served count)

    def of(self, priority: str, start: float = 0.0, end: float = float("inf")) -> list[Sent]:
        return [s for s in self.sent if s.priority == priority and start <= s.at < end]


def percentile(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, len(ordered) * p // 100)] if ordered else float("nan")


async def _one(client: httpx.AsyncClient, url: str, stream: Stream, origin: float, run: Run) -> None:
    started = time.perf_counter()
    try:
        response = await client.get(url, headers=stream.headers)
        status, retry_after = response.status_code, response.headers.get("retry-after")
    except httpx.HTTPError:
        status, retry_after = 0, None
    run.sent.append(Sent(started - origin, stream.priority, status, time.perf_counter() - started, retry_after))


async def _offer(client: httpx.AsyncClient, url: str, stream: Stream, origin: float, until: float, run: Run,
                 tasks: set[asyncio.Task[None]]) -> None:
    interval = 1.0 / stream.rate
    due = time.perf_counter()
    while due < until:
        task = asyncio.create_task(_one(client, url, stream, origin, run))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        due += interval
        await asyncio.sleep(max(0.0, due - time.perf_counter()))


async def _watch(client: httpx.AsyncClient, stats_url: str, origin: float, until: float, run: Run) -> None:
    while time.perf_counter() < until:
        try:
            served = (await client.get(stats_url)).json()["served"]
            run.served.append((time.perf_counter() - origin, served))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)


async def offer(url: str, phases: list[tuple[float, list[Stream]]], stats_url: str | None = None,
                timeout: float = 30.0, run: Run | None = None) -> Run:
    """Each phase's streams for its seconds, one phase after another; waits for every answer."""
    run = run if run is not None else Run()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        origin = time.perf_counter()
        total = sum(seconds for seconds, _ in phases)
        watcher = asyncio.create_task(_watch(client, stats_url, origin, origin + total, run)) if stats_url else None
        start = origin
        for seconds, streams in phases:
            until = start + seconds
            await asyncio.gather(*(_offer(client, url, s, origin, until, run, tasks) for s in streams),
                                 asyncio.sleep(max(0.0, until - time.perf_counter())))
            start = until
        while tasks:
            await asyncio.gather(*list(tasks))
        if watcher is not None:
            await watcher
    return run


def goodput(run: Run, start: float, end: float) -> float:
    """Answers the upstream gave a second between `start` and `end` (seconds since the load began)."""
    inside = [(at, served) for at, served in run.served if start <= at <= end]
    if len(inside) < 2:
        return float("nan")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def answered(run: Run, start: float, end: float) -> float:
    """200 answers clients received a second between `start` and `end`: the useful work (an answer
    the upstream gave after the gateway or the client had given up on it is not in it)."""
    return sum(s.status == 200 and start <= s.at + s.seconds < end for s in run.sent) / (end - start)
