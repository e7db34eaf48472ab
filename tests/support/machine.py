"""The machine's share between the suite's workers (pytest-xdist): every test takes a share for as
long as it runs, and a test marked `alone` takes the machine to itself while its load runs (wrk
saturating a worker, an upstream offered three times its capacity), so that the latency or recovery
it judges under that load is not the other tests' doing.

A reader-writer lock on two files in the directory the workers' temporary directories share. The
writer takes a turnstile before it waits, so the tests that keep starting beside one another cannot
keep it waiting. Run without xdist, both are no-ops.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

SHARED: Path | None = None  # set by tests/conftest.py from the session's temporary directories
_sharing = False            # this worker's test holds a share


def _shared() -> Path | None:
    return SHARED if os.environ.get("PYTEST_XDIST_WORKER") is not None else None


@contextmanager
def _held(exclusive: bool) -> Iterator[None]:
    shared = _shared()
    if shared is None:
        yield
        return
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@contextmanager
def a_share() -> Iterator[None]:
    """What every test not marked `alone` holds while it runs (tests/conftest.py)."""
    global _sharing
    with _held(exclusive=False):
        _sharing = True
        try:
            yield
        finally:
            _sharing = False


def to_itself() -> AbstractContextManager[None]:
    """No other test runs inside this block. Only a test marked `alone` may enter it: any other
    holds a share, and would wait on itself here."""
    assert not _sharing, "only a test marked alone takes the machine to itself"
    return _held(exclusive=True)
