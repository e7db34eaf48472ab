"""gateway/scratch_dirs.py: a scratch directory goes when its owner goes, however it went, and
never while its owner runs."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gateway import scratch_dirs
from tests.support.orphans import started

OWN_ONE = ("import sys, tempfile\ntempfile.tempdir = sys.argv[1]\n"
           "from gateway.scratch_dirs import scratch_dir\nprint(scratch_dir('gateway-x-'), flush=True)\n"
           "sys.stdin.read()\n")


def owner(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    process = started([sys.executable, "-c", OWN_ONE, str(tmp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().decode().strip())


def test_a_killed_owners_directory_goes_and_a_running_owners_stays(tmp_path: Path) -> None:
    killed, left = owner(tmp_path)
    running, kept = owner(tmp_path)
    owners = [killed, running]
    try:
        (left / "counter_1.db").write_bytes(b"\0" * 4096)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert left.is_dir(), "nobody removes it at its owner's death"
        third, made = owner(tmp_path)  # the next one made sweeps
        owners.append(third)
        assert not left.exists()
        assert kept.is_dir() and made.is_dir()
        assert (kept / ".owner").exists()
    finally:
        for process in owners:
            process.kill()
            process.communicate()


def test_a_sweep_at_the_instant_a_directory_is_made_leaves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight gateways starting together: one's sweep ran between another's creating its owner file
    and locking it, took the free lock and removed the directory (a worker then failed to start:
    its metrics file's directory was gone). The sweep here runs at that instant."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lock = fcntl.flock

    def sweeping_first(fd: int, operation: int) -> None:
        scratch_dirs.sweep("gateway-race-")  # another process's sweep (flock: one open file against another)
        lock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", sweeping_first)
    made = Path(scratch_dirs.scratch_dir("gateway-race-"))
    monkeypatch.setattr(fcntl, "flock", lock)
    try:
        assert made.is_dir() and (made / scratch_dirs.OWNER).exists()
        scratch_dirs.sweep("gateway-race-")  # held: a later sweep leaves it too
        assert made.is_dir()
    finally:
        scratch_dirs.remove(str(made))
