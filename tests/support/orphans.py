"""Processes the suite starts die with it: a test run killed by a timeout (SIGKILL included) leaves
no gateway, Redis, proxy or upstream behind. Linux's parent-death signal, asked for by the child
between fork and exec (gateway/parent_death.py), follows the thread that started the child, so it
is asked for only from the main thread; a child started from another thread is stopped by its test.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from gateway.parent_death import dying_with_this_process


def dies_with_the_suite() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: SIGTERM to the child when the test run ends, however."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return dying_with_this_process(signal.SIGTERM)
