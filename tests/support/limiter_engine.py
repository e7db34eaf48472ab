"""The decision engine (gateway.limiter.Limiter running lua/decide.lua) driven synchronously, against a
real redis-server whose clock the test sets to the microsecond (libfaketime, frozen between sets)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gateway.config import RedisSettings, Rule
from gateway.limiter import Decision, Limiter, rule_spec
from gateway.redis import make_runner
from tests.support.redis_proc import RedisClock, RedisProcess

T0 = 1_800_000_000_000_000  # µs; a moment aligned to every window the tests use


class Engine:
    """One Limiter on its own event loop. `at(t)` freezes Redis's clock at t µs since the epoch."""

    def __init__(self, proc: RedisProcess, clock: RedisClock | None) -> None:
        self.proc = proc
        self.clock = clock
        self.client = proc.client()
        self.loop = asyncio.new_event_loop()
        self.limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=2.0)))
        self.now = T0

    def at(self, t: int) -> None:
        assert self.clock is not None
        self.clock.set(t / 1_000_000)
        self.now = t

    def decide(self, rules: Sequence[Rule], keys: list[str], costs: Sequence[int | None],
               peek: bool = False) -> Decision:
        coro = self.limiter.decide([rule_spec(r) for r in rules], keys, costs, peek=peek)
        return self.loop.run_until_complete(coro)

    def redis_time(self) -> int:
        seconds, micros = self.client.time()
        return seconds * 1_000_000 + micros

    def close(self) -> None:
        self.loop.run_until_complete(self.limiter.close())
        self.loop.close()
        self.client.close()


@contextmanager
def clocked_server(binary: str, directory: Path) -> Iterator[Engine]:
    """A redis-server of the given binary with a frozen, settable clock, and an Engine on it."""
    clock = RedisClock(directory / "clock", start=T0 / 1_000_000)
    proc = RedisProcess(binary, clock_file=clock.path)
    proc.start()
    engine = Engine(proc, clock)
    try:
        yield engine
    finally:
        engine.close()
        proc.stop()


def fresh_keys(count: int, route: str = "r") -> list[str]:
    """Keys of one route (one hash tag) that no other example uses."""
    tag = uuid.uuid4().hex[:12]
    return [f"t:{{{route}}}:{i}:{tag}" for i in range(count)]


def ms(us: int) -> int:
    """Microseconds -> the whole milliseconds the Decision reports (rounded up; -1 stays -1)."""
    return -(-us // 1000) if us >= 0 else -1
