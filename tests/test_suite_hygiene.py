"""The suite itself: a test run killed outright leaves nothing running, and its time factor is one
number, set once (tests/support/patience.py, tests/support/orphans.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import patience
from tests.support.orphans import started
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import json, os, time
from pathlib import Path
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

def test_started_then_killed(tmp_path):
    redis, upstream = RedisProcess(), Upstream()
    redis.start()
    upstream.start()
    gateway = GatewayProcess("""
version: 1
upstreams: {{up: {{url: "{url}"}}}}
routes:
  - name: r
    match: {{path: /r}}
    upstream: up
    limits: [{{name: all, by: [], algorithm: fixed_window, limit: 5, window: 1m}}]
""".format(url=upstream.url), tmp_path, redis_url=redis.url, workers=2)
    gateway.start()
    children = Path(f"/proc/{gateway.process.pid}/task/{gateway.process.pid}/children").read_text().split()
    Path(os.environ["PIDS_FILE"]).write_text(json.dumps(
        [redis.process.pid, upstream.process.pid, gateway.process.pid, *map(int, children)]))
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_a_test_run_killed_outright_leaves_no_gateway_redis_or_upstream_behind(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    pids_file = tmp_path / "pids.json"
    output = (tmp_path / "inner.log").open("wb")
    env = {**os.environ, "PIDS_FILE": str(pids_file), "PYTHONPATH": str(ROOT)}
    inner = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_inner.py")]
    run = subprocess.Popen(inner, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        def started() -> bool:
            assert run.poll() is None, (tmp_path / "inner.log").read_text()
            return pids_file.exists() and pids_file.stat().st_size > 0
        wait_until(started, timeout=60)
        pids = json.loads(pids_file.read_text())
        assert len(pids) >= 5 and all(_alive(pid) for pid in pids)  # Redis, upstream, supervisor, its workers
    finally:
        run.send_signal(signal.SIGKILL)  # as a CI timeout does: no teardown runs
        run.wait()
        output.close()
    wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=15)


def test_the_time_factor_is_set_once_and_reaches_child_processes() -> None:
    factor = patience.factor()
    assert 1.0 <= factor <= patience.MOST
    assert os.environ[patience.ENV] == str(factor)
    seen = subprocess.run([sys.executable, "-c", "from tests.support import patience; print(patience.factor())"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert float(seen) == factor
    assert patience.within(3.0) == 3.0 * factor


def test_processes_start_with_sigint_at_its_default_even_when_the_run_ignores_it() -> None:
    """A suite started in the background by a script ignores SIGINT; what it starts must not, or a
    test that interrupts `make run` tests nothing a terminal user would see."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = started(["sleep", "30"])
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        def exec_done() -> bool:  # setpriv and env have executed the command
            return Path(f"/proc/{child.pid}/comm").read_text().strip() == "sleep"

        wait_until(exec_done, timeout=10)
        status = Path(f"/proc/{child.pid}/status").read_text()
        mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
        assert not mask & (1 << (signal.SIGINT - 1)), f"SigIgn {mask:x}"
    finally:
        child.kill()
        child.wait()
