"""Children that do not outlive their parent: Linux's parent-death signal, prctl(PR_SET_PDEATHSIG).

The kernel sends the signal when the *thread* that forked the child exits, however the parent died
(SIGKILL and the OOM killer included), so only a process started from its parent's main thread may
ask for it. A parent that died before the request was made is caught by comparing getppid() with
the pid the child expects: after that check the kernel's promise holds. Elsewhere than Linux this
is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def die_with_parent(signum: int, parent: int) -> None:
    """Have `signum` sent to this process when its parent dies; exit at once if `parent`, the pid
    this process was started by, is already gone (the signal would never come)."""
    prctl = _prctl()
    if prctl is None:
        return
    if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def dying_with_this_process(signum: int) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when this process dies. Call it
    from the main thread (the kernel follows the forking thread). libc is looked up here, before
    the fork: the child only makes two system calls."""
    _prctl()
    parent = os.getpid()
    return functools.partial(die_with_parent, signum, parent)
