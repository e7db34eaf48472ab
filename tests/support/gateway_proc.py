"""The gateway under test as a real process: `python -m gateway serve` with its own config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess:
    def __init__(self, config_text: str, workdir: Path, redis_url: str | None = None,
                 workers: int = 1, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 http: str = "gateway", transport: str = "lean", rls_server: str = "lean") -> None:
        self.config_path = workdir / "routes.yaml"
        self.config_path.write_text(textwrap.dedent(config_text))
        self.port = free_port()
        self.admin_port = free_port()
        self.redis_url = redis_url
        self.workers = workers
        self.env = env or {}
        self.extra_args = args  # after the defaults: a flag given here wins
        # the libraries' own protocol or transport instead of the gateway's: tests.support.comparison_gateway
        self.comparison = (http, transport, rls_server) != ("gateway", "lean", "lean")
        self.rls_server = rls_server  # "grpclib" or "h2": tests.support.rls_comparison
        self.http = http
        self.transport = transport
        self.log_path = workdir / "gateway.log"
        self.out_path = workdir / "gateway.out"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, ready: bool = True) -> None:
        launcher = ["-m", "gateway"]
        if self.comparison:
            launcher = ["-m", "tests.support.comparison_gateway", "--http", self.http, "--transport", self.transport]
            if self.rls_server != "lean":
                launcher = ["-m", "tests.support.rls_comparison", self.rls_server]
        args = [sys.executable, *launcher, "serve", "--config", str(self.config_path),
                "--host", "127.0.0.1", "--port", str(self.port), "--admin-port", str(self.admin_port),
                "--workers", str(self.workers)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        args += self.extra_args
        env = dict(os.environ, **self.env)
        if self.comparison:  # the launcher is a module of this source tree
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("GATEWAY_DRAIN_TIMEOUT", "5")
        env.setdefault("XDG_STATE_HOME", str(self.config_path.parent / "state"))  # the embedded Redis's, not ~'s
        with self.out_path.open("ab") as out, self.log_path.open("ab") as err:
            self.process = started(args, env=env, stdout=out, stderr=err, start_new_session=True)
        if ready:
            wait_until(self.ready, timeout=30)

    def ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
        try:
            return httpx.get(self.admin_url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:  # gone meanwhile
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.process.pid and b"spawn_main" in cmdline:
                    pids.append(int(entry.name))
        return pids

    def stop(self, timeout: float = 30.0) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        code = self.process.returncode
        self.process = None
        return code
