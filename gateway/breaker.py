"""A circuit breaker for the Redis connection: stop calling a dead Redis; a probe off the request
path finds its return (gateway.limiter runs it).

No request is ever the probe. A request's budget is redis.timeout (50 ms by default), and the first
call to a Redis that came back must connect, say who it is, and load the scripts again: several
round trips, each waiting its turn on an event loop that a saturated worker keeps busy for tens of
milliseconds. A request-borne probe then timed out every time, the breaker opened again, and the
limits never came back while the load lasted. The probe has a budget of its own.
"""

from __future__ import annotations

import time
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2  # the probe is asking Redis


class Breaker:
    def __init__(self, failures_to_open: int = 5, open_for: float = 1.0) -> None:
        self.failures_to_open = failures_to_open
        self.open_for = open_for  # seconds between probes while open
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._last_failure: BaseException | None = None  # counted already (see record_failure)
        self._opened_at = 0.0   # when it last opened (monotonic)
        self._counted_to = 0.0  # time open is reported up to here (`open_time`)

    def allow(self) -> bool:
        """May a request's call go to Redis now? Only while closed."""
        return self.state is BreakerState.CLOSED

    def record_success(self) -> None:
        """A request's call was answered: failures in a row start again from none."""
        self._failures = 0  # (the last failure is kept: a new one is never the same object)

    def record_failure(self, failure: BaseException | None = None) -> bool:
        """Count a failed round trip to Redis; return True when it opened the breaker.

        The calls of one batch fail together with one exception (`failure`; in a Cluster, one per
        node) and count once: a batch holds tens of calls under load, and counting each made one
        batch Redis answered late (a stall just over the budget) turn the limits off for a second,
        as an outage does."""
        if failure is not None and failure is self._last_failure:
            return False
        self._last_failure = failure
        self._failures += 1
        if self.state is BreakerState.CLOSED and self._failures >= self.failures_to_open:
            self.state = BreakerState.OPEN
            self._opened_at = self._counted_to = time.monotonic()
            return True
        return False

    def probing(self) -> None:
        self.state = BreakerState.HALF_OPEN

    def probe_failed(self) -> None:
        self.state = BreakerState.OPEN

    def close(self) -> float:
        """The probe was answered: close, and return how long the breaker was open."""
        self.state = BreakerState.CLOSED
        self._failures = 0
        return time.monotonic() - self._opened_at

    def open_time(self) -> float:
        """Seconds open since the last call (for a counter that grows while it is open)."""
        now = time.monotonic()
        spent, self._counted_to = now - self._counted_to, now
        return max(spent, 0.0)
