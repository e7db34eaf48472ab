"""Who is being limited: the identities refused most, in bounded memory (`GET /top` on the admin port).

Each worker counts its refusals (route, rule, identity token, and the consumer of the request's API
key, when it has one) in one Space-Saving sketch per minute
(Metwally, Agrawal and El Abbadi, 2005): at most `capacity` counters a minute, so a flood of
distinct identities costs a fixed amount of memory; an identity refused more than 1/capacity of
a minute's refusals is always among them, and its count is over by at most the minute's smallest
counter (reported as `error`). Minutes older than `MAX_WINDOW` are dropped.

Workers share a directory (the supervisor's metrics directory): each writes its minutes there
every second, and `/top` on any worker merges every worker's, so the answer is the gateway's.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MINUTE = 60
MAX_WINDOW = 60 * MINUTE
CAPACITY = 256

Item = tuple[str, str, str, str]  # route, rule, identity token, consumer ("" without one)


class SpaceSaving:
    """At most `capacity` counters; a new item past that takes the smallest counter's place."""

    __slots__ = ("capacity", "counts", "errors")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.counts: dict[Item, int] = {}
        self.errors: dict[Item, int] = {}

    def add(self, item: Item, count: int = 1) -> None:
        counts = self.counts
        if item in counts:
            counts[item] += count
        elif len(counts) < self.capacity:
            counts[item] = count
        else:
            smallest = min(counts, key=counts.__getitem__)
            floor = counts.pop(smallest)
            self.errors.pop(smallest, None)
            counts[item] = floor + count
            self.errors[item] = floor

    def items(self) -> Iterator[tuple[Item, int, int]]:
        for item, count in self.counts.items():
            yield item, count, self.errors.get(item, 0)


@dataclass(frozen=True)
class Refused:
    route: str
    rule: str
    identity: str
    consumer: str
    refusals: int
    error: int  # the count may be over by at most this much (0: exact)


class TopRefused:
    def __init__(self, capacity: int = CAPACITY, directory: str | None = None) -> None:
        self.capacity = capacity
        self.minutes: dict[int, SpaceSaving] = {}
        self.directory = Path(directory) if directory else None
        self.changed = False

    def record(self, route: str, rule: str, identity: str, consumer: str = "", now: float | None = None) -> None:
        minute = int((time.time() if now is None else now) // MINUTE)
        sketch = self.minutes.get(minute)
        if sketch is None:
            sketch = self.minutes[minute] = SpaceSaving(self.capacity)
            for old in [m for m in self.minutes if m <= minute - MAX_WINDOW // MINUTE]:
                del self.minutes[old]
        sketch.add((route, rule, identity, consumer))
        self.changed = True

    def save(self) -> None:
        """This worker's minutes, for the others to merge (written whole, then renamed into place)."""
        if self.directory is None or not self.changed:
            return
        self.changed = False
        data = {str(m): [[*item, count, error] for item, count, error in s.items()] for m, s in self.minutes.items()}
        path = self.directory / f"top-{os.getpid()}.json"
        temporary = path.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(data))
            temporary.replace(path)

    def top(self, window: float, route: str | None = None, limit: int = 20,
            now: float | None = None) -> list[Refused]:
        """The identities refused most in the last `window` seconds, all workers together."""
        first = int(((time.time() if now is None else now) - window) // MINUTE) + 1
        totals: dict[Item, list[int]] = {}
        for minute, entries in self._every_workers_minutes():
            if minute < first:
                continue
            for item, count, error in entries:
                if route is not None and item[0] != route:
                    continue
                total = totals.setdefault(item, [0, 0])
                total[0] += count
                total[1] += error
        ranked = sorted(totals.items(), key=lambda entry: (-entry[1][0], entry[0]))[:limit]
        return [Refused(*item, count, error) for item, (count, error) in ranked]

    def _every_workers_minutes(self) -> Iterable[tuple[int, list[tuple[Item, int, int]]]]:
        own = f"top-{os.getpid()}.json"
        for minute, sketch in list(self.minutes.items()):
            yield minute, list(sketch.items())
        if self.directory is None:
            return
        for path in self.directory.glob("top-*.json"):
            if path.name == own:
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a worker gone, or a file half written by another system
            for minute, entries in data.items():
                yield int(minute), [_entry(e) for e in entries]


def _entry(saved: list[str | int]) -> tuple[Item, int, int]:
    """One saved counter: route, rule, identity, consumer, count, error (without the consumer: a
    worker of an older version)."""
    *item, count, error = saved
    route, rule, identity, consumer = (*(str(part) for part in item), "")[:4]
    return (route, rule, identity, consumer), int(count), int(error)
