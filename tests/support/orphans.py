"""Processes the suite starts die with it: a test run killed by a timeout (SIGKILL included) leaves
no gateway, Redis, proxy or upstream behind. Each is started through util-linux's `setpriv
--pdeathsig TERM`, which asks Linux for the parent-death signal and then executes the command (the
signal survives the exec), so the test process itself runs no code between fork and exec: a
`preexec_fn` made Python fork instead of vfork, and a process with grpcio's threads (the RLS
tests) then ran grpc's fork handlers in the child, which died at start. The signal follows the
thread that started the child, so it is asked for only from the main thread; a child started from
another thread is stopped by its test.

Each also starts with SIGINT and SIGQUIT at their default action, as from a terminal: a shell
without job control starts its background jobs with both ignored, and an ignored signal stays
ignored across exec, so a suite run as `make test &` from a script had `make run` ignore the SIGINT
its test sends it (the test waited 60 s and failed; run in the foreground it passed).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

SETPRIV = shutil.which("setpriv")
AS_FROM_A_TERMINAL = ["env", "--default-signal=INT,QUIT"]


def dying(args: Sequence[str]) -> list[str]:
    """`args`, started so that the process gets SIGTERM when the test run ends, however."""
    command = [*AS_FROM_A_TERMINAL, *args]
    if SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return command
    return [SETPRIV, "--pdeathsig", "TERM", "--", *command]


def started(args: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen of `args` (a list, not a shell string), dying with the test run."""
    return subprocess.Popen(dying(args), **options)
