"""The suite's one time factor: every time limit a test waits for or asserts is multiplied by it.

Measured once, when the session starts, from how many other tasks are ready to run per core
(/proc/stat's procs_running, sampled for half a second): 1.0 on a quiet machine, about 2.0 with two
CPU hogs on two cores; each other worker of the suite counts as one more task.
`GATEWAY_TEST_TIME_FACTOR` sets it instead (and carries it to the processes a test starts). A
behaviour bar such as "the limits apply again within 3 s" is `within(3.0)`: the bar a quiet
machine meets, stretched only by the share of CPU the machine leaves the test.
"""

from __future__ import annotations

import os
import time

ENV = "GATEWAY_TEST_TIME_FACTOR"
MOST = 4.0


def _ready_tasks() -> int:
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith("procs_running "):
                return int(line.split()[1])
    return 1


def measure(samples: int = 10, interval: float = 0.05) -> float:
    others = 0.0
    for _ in range(samples):
        others += max(_ready_tasks() - 1, 0)  # less this process, which is running to read it
        time.sleep(interval)
    cores = os.cpu_count() or 1
    return round(min(max(1.0 + others / samples / cores, 1.0), MOST), 1)


def factor() -> float:
    """The session's factor: measured on the first call (conftest makes that call at start). The
    suite's other workers (pytest-xdist) count as ready tasks though they may not have started yet:
    the time they will take from this one is part of the share the machine leaves it."""
    text = os.environ.get(ENV)
    if text is None:
        siblings = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1, 0)
        measured = measure() + siblings / (os.cpu_count() or 1)
        text = str(round(min(measured, MOST), 1))
        os.environ[ENV] = text
    return float(text)


def within(seconds: float) -> float:
    return seconds * factor()
