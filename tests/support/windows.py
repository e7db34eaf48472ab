"""Windows aligned to the clock (a fixed_window of 1m, envoyproxy/ratelimit's `unit: minute`: each
starts at :00) make a test that counts up to a limit race the window's edge: 20 calls under a
20-a-minute limit with the minute turning between them leave the 21st admitted (it failed a run
with two CPU hogs). conftest.py starts every test clear of a minute's edge."""

from __future__ import annotations

import time

from tests.support.patience import within


def clear_of_the_edge(period: float = 60.0, margin: float = 2.0) -> None:
    """Return once at least `margin` (scaled by the suite's factor) is left of the current `period`,
    waiting for the next one to start if less is. At most one wait a period."""
    left = period - time.time() % period
    if left < within(margin):
        time.sleep(left + 0.01)  # the clock is the one thing no event announces
