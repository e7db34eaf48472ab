"""A circuit breaker for the Redis connection: stop calling a dead Redis, probe for its return."""

from __future__ import annotations

import time
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breaker:
    def __init__(self, failures_to_open: int = 5, open_for: float = 1.0) -> None:
        self.failures_to_open = failures_to_open
        self.open_for = open_for
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """May a call go to Redis now? In half-open state exactly one probe goes at a time."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if time.monotonic() - self._opened_at < self.open_for:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def record_success(self) -> None:
        self._failures = 0
        self._probing = False
        self.state = BreakerState.CLOSED

    def record_failure(self) -> bool:
        """Count a failure; return True when this failure opened the breaker."""
        self._failures += 1
        self._probing = False
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.failures_to_open:
            opened = self.state is not BreakerState.OPEN
            self.state = BreakerState.OPEN
            self._opened_at = time.monotonic()
            return opened
        return False
