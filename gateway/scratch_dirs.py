"""Private directories under the temporary directory (the metrics' files, the embedded Redis's
socket) that outlive no one. Each holds a lock for as long as the process that made it runs; making
one removes those of the same kind whose lock nobody holds any more, left by a gateway that was
SIGKILLed or OOM-killed and could not remove its own. A lock, not a pid: pids are reused, and a
temporary directory may be shared across pid namespaces."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

OWNER = ".owner"
_held: dict[str, int] = {}  # each directory this process made -> its lock's descriptor


def scratch_dir(prefix: str, under: str | None = None) -> str:
    """A new directory `<tmp>/<prefix>XXXXXXXX` (or under `under`), locked while this process runs."""
    sweep(prefix, under)
    path = tempfile.mkdtemp(prefix=prefix, dir=under)
    # locked under another name, then renamed: another process's sweep never sees an owner file
    # nobody holds yet (it would take the lock and remove the directory being made)
    claim = os.path.join(path, OWNER + ".new")
    fd = os.open(claim, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(claim, os.path.join(path, OWNER))
    _held[path] = fd
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep(prefix: str, under: str | None = None) -> None:
    """Remove the directories of `prefix` whose owner is gone."""
    for candidate in Path(under or tempfile.gettempdir()).glob(prefix + "*"):
        try:
            fd = os.open(candidate / OWNER, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # being made this instant, or not one of ours
        try:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(candidate, ignore_errors=True)
        finally:
            os.close(fd)
