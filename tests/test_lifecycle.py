"""Nothing outlives the main process (issue 23): a `gateway serve` killed by any signal, SIGKILL
included, takes its workers and its embedded redis-server with it, and the ports are free again for
the next start; `make run` stops on a signal sent to make's own pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]

ROUTES = """
version: 1
upstreams: {{up: {{url: "{upstream}", timeout: 30s}}}}
routes:
  - name: all
    match: {{path: "/{{rest:path}}"}}
    upstream: up
    limits: [{{name: g, by: [], algorithm: gcra, rate: 1000/s, burst: 1000}}]
"""


def children(pid: int) -> dict[int, bytes]:
    """The live processes whose parent is `pid`, with their command lines."""
    found: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found[int(entry.name)] = cmdline
    return found


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet (its sockets are closed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def connections_to(port: int) -> int:
    """Established TCP connections to `port` on this machine (IPv4, /proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":
            count += 1
    return count


def get_quietly(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # cut when its worker stops: what the test is about
        httpx.get(url, timeout=30)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_supervisor_killed_with_sigkill_leaves_nothing_behind(workers: int, tmp_path: Path,
                                                                upstream: Upstream) -> None:
    # the gateway's temporary directory (its metrics' and Redis's scratch dirs): short, as a unix
    # socket's path must be (the suite's own tmp_path is long under pytest-xdist)
    scratch = Path(tempfile.mkdtemp(prefix="lc-", dir="/tmp"))
    gateway = GatewayProcess(ROUTES.format(upstream=upstream.url), tmp_path, workers=workers,  # embedded Redis
                             env={"TMPDIR": str(scratch)})
    gateway.start()
    assert gateway.process is not None
    supervisor = gateway.process.pid
    left: list[int] = []
    try:
        wait_until(lambda: len(gateway.worker_pids()) == workers, timeout=10)
        left = gateway.worker_pids() + [pid for pid, cmd in children(supervisor).items() if b"redis-server" in cmd]
        assert len(left) == workers + 1, children(supervisor)
        # a request still in flight when the supervisor dies does not hold its worker past the bound
        slow = threading.Thread(target=get_quietly, args=(gateway.url + "/slow?delay=5",))
        slow.start()
        wait_until(lambda: connections_to(upstream.port) > 0, timeout=5)  # forwarded, waiting upstream

        os.kill(supervisor, signal.SIGKILL)
        gateway.process.wait()
        try:
            wait_until(lambda: all(gone(pid) for pid in left), timeout=2)
        except TimeoutError:
            pytest.fail(f"still running 2 s after the supervisor's SIGKILL: {[p for p in left if not gone(p)]}")
        assert bindable(gateway.port) and bindable(gateway.admin_port), "the next start can listen"
        slow.join(30)
        assert sorted(p.name.rsplit("-", 1)[0] for p in scratch.iterdir()) == ["gateway-metrics", "gateway-redis"]
        gateway.start()  # the next start removes what the killed one left in the temporary directory
        gateway.stop()
        assert list(scratch.iterdir()) == []
        scratch.rmdir()
    finally:
        for pid in left:  # never leave one running, whatever failed
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        gateway.stop()


def test_a_child_whose_parent_died_before_it_asked_exits_at_once() -> None:
    """The race the parent-death signal leaves open: a parent gone before the prctl sends nothing."""
    code = ("import os, signal, sys\nfrom gateway.parent_death import die_with_parent\n"
            "die_with_parent(signal.SIGTERM, int(sys.argv[1]))\nprint('waiting for a signal')")
    mine = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert mine.returncode == 0 and mine.stdout == "waiting for a signal\n", mine.stderr
    other = subprocess.run([sys.executable, "-c", code, str(os.getppid())], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert other.returncode == 1 and other.stdout == "", "started by another pid than it expects: gone"


def in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (fields after the command name: state, ppid, pgrp, session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def make_run(venv: Path, run_args: str) -> list[str]:
    """`make run` with the venv under test used as it is, never reinstalled (-o)."""
    return ["make", "--no-print-directory", "run", "-o", f"{venv}/.installed-run", f"VENV={venv}",
            f"RUN_ARGS={run_args}"]


def make_run_started(tmp_path: Path, ports: tuple[int, int, int]) -> subprocess.Popen[bytes]:
    """`make run` on `ports` (proxy, admin, backend), its state in `tmp_path`, in a session of its
    own: a signal sent to make reaches make alone, as from a script or an IDE's stop button."""
    venv = Path(sys.executable).parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "MAKE"))}
    env["TMPDIR"] = str(tmp_path)
    port, admin, backend = ports
    with (tmp_path / "make.log").open("ab") as log:
        return started(make_run(venv, f"--port {port} --admin-port {admin} --backend-port {backend} "
                                      f"--data-dir {tmp_path / 'state'}"),
                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def making_run(tmp_path: Path, ports: tuple[int, int, int]) -> Iterator[subprocess.Popen[bytes]]:
    """`make run`, serving; killed with all it started if still there after."""
    make = make_run_started(tmp_path, ports)
    try:
        seen: list[str] = []

        def serving() -> bool:
            assert make.poll() is None, (tmp_path / "make.log").read_text()
            try:
                status = httpx.get(f"http://127.0.0.1:{ports[0]}/products", timeout=2).status_code
            except httpx.HTTPError as exc:
                seen.append(repr(exc))
                return False
            seen.append(str(status))
            return status == 200

        try:
            wait_until(serving, timeout=60, interval=0.2)
        except TimeoutError as exc:
            raise AssertionError(f"last answers: {seen[-3:]}\n" + (tmp_path / "make.log").read_text()) from exc
        yield make
    finally:
        if make.poll() is None or in_session(make.pid):
            os.killpg(make.pid, signal.SIGKILL)  # the backend and Redis follow: parent-death signal
            make.wait()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_make_run_stops_on_a_signal_to_makes_own_pid(sig: signal.Signals, tmp_path: Path) -> None:
    ports = (free_port(), free_port(), free_port())
    with making_run(tmp_path, ports) as make:
        assert len(in_session(make.pid)) >= 5, "make, the script, the backend, the gateway and its worker"
        make.send_signal(sig)
        make.wait(timeout=60)
        assert make.returncode == -sig, (tmp_path / "make.log").read_text()
        wait_until(lambda: in_session(make.pid) == [], timeout=10)
        assert all(bindable(p) for p in ports)
    assert "Traceback" not in (tmp_path / "make.log").read_text()


@pytest.mark.timeout(180)
def test_ctrl_c_to_make_run_lets_an_answer_in_flight_finish_and_settle(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals make's whole group: the gateway drains, and the backend and the
    embedded Redis stop after it, so a streamed answer already under way arrives whole and its
    token budget settles (before, Redis stopped at once and the budget kept the reserve)."""
    ports = (free_port(), free_port(), free_port())
    url, admin = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
    with making_run(tmp_path, ports) as make:
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, headers={"X-Api-Key": "k1"},
                          json={"max_tokens": 100, "stream": True}) as answer:
            lines = answer.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.killpg(make.pid, signal.SIGINT)  # the terminal's Ctrl-C: make and all it started
            events += [line for line in lines if line.startswith("data: ")]
        assert answer.status_code == 200 and events[-1] == "data: [DONE]", events
        assert '"total_tokens": 19' in events[-2]
        make.wait(timeout=60)
        wait_until(lambda: in_session(make.pid) == [], timeout=10)
    with making_run(tmp_path, ports):  # the same state directory
        budget = httpx.get(admin + "/limits/chat/tokens-hour", params={"key": "k1"}, timeout=10).json()
        assert budget["remaining"] == 2000 - 19, "what the answer used, not the reserve (max_tokens and prompt)"
    assert "Traceback" not in (tmp_path / "make.log").read_text()


@pytest.mark.timeout(180)
def test_make_run_with_the_backends_port_taken_stops_and_says_so(tmp_path: Path) -> None:
    """Before, the gateway went on serving with no backend behind it: every request waited for its
    upstream timeout and got a 504."""
    port, admin, backend = ports = (free_port(), free_port(), free_port())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", backend))
        taken.listen()
        make = make_run_started(tmp_path, ports)
        try:
            assert make.wait(timeout=60) != 0
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait()
    said = (tmp_path / "make.log").read_text()
    assert f"the example backend on port {backend} exited" in said, said
    assert "Traceback" not in said
    wait_until(lambda: in_session(make.pid) == [], timeout=10)
    assert bindable(port) and bindable(admin)


def test_an_embedded_redis_starts_under_a_temporary_directory_too_long_for_a_socket(tmp_path: Path) -> None:
    """A unix socket's path holds at most 107 bytes: under a longer TMPDIR the embedded Redis's
    socket goes to /tmp (before, redis-server started without it and the gateway gave up after 10 s,
    saying only that it did not start in time)."""
    from gateway.embedded import EmbeddedRedis

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    previous = tempfile.tempdir
    tempfile.tempdir = str(deep)
    try:
        redis = EmbeddedRedis()
    finally:
        tempfile.tempdir = previous
    try:
        redis.start()
        assert redis.ping()
        assert len(os.fsencode(redis.socket_path)) <= 107 and redis.socket_path.startswith("/tmp/")
    finally:
        redis.stop()
    assert not Path(redis.socket_path).parent.exists()


ONE_AT_A_TIME = """
version: 1
upstreams: {{up: {{url: "{upstream}", timeout: 30s}}}}
routes:
  - name: slow
    match: {{path: /slow}}
    upstream: up
    limits: [{{name: one, by: [], algorithm: concurrency, limit: 1}}]
"""


def test_ctrl_c_lets_a_request_in_flight_give_its_slot_back_before_the_embedded_redis_stops(
        tmp_path: Path, upstream: Upstream) -> None:
    """A terminal's Ctrl-C signals the whole foreground group. The embedded Redis keeps running until
    the gateway has drained: the slot a request in flight holds is given back, not lost in the
    --data-dir state until its lease runs out (before, Redis stopped first and the next start
    refused the route's one slot)."""
    gateway = GatewayProcess(ONE_AT_A_TIME.format(upstream=upstream.url), tmp_path,
                             env={"GATEWAY_DATA_DIR": str(tmp_path / "state")})
    gateway.start()
    assert gateway.process is not None
    try:
        arrived = upstream.arrived("/slow")
        answers: list[int] = []
        slow = threading.Thread(target=lambda: answers.append(
            httpx.get(gateway.url + "/slow", params={"delay": "1.5"}, timeout=30).status_code))
        slow.start()
        wait_until(lambda: upstream.arrived("/slow") == arrived + 1, timeout=10)
        os.killpg(gateway.process.pid, signal.SIGINT)  # the group, as a terminal's Ctrl-C
        slow.join(30)
        assert answers == [200]
        assert gateway.process.wait(30) == 0
        gateway.start()
        assert httpx.get(gateway.url + "/slow", params={"delay": "0"}, timeout=10).status_code == 200
    finally:
        gateway.stop()
