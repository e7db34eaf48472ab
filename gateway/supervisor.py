"""`gateway serve`: bind the two ports, start the embedded Redis if needed, run N workers.

The supervisor owns the sockets, the embedded redis-server and the metrics directory. It forwards
SIGHUP (and changes of the config file) to the workers, which each validate and swap the config;
on SIGTERM it lets the workers drain, stops Redis and exits 0.

Nothing outlives it: if it dies without that (SIGKILL, the OOM killer, a crash), the kernel signals
the embedded redis-server (SIGTERM) and every worker (SIGUSR1: stop accepting at once, cut whatever
is still in flight after ORPHAN_GRACE seconds), so the ports are free for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from gateway.config import Config, load_config
from gateway.embedded import EmbeddedRedis, start_embedded
from gateway.errors import ConfigError
from gateway.parent_death import die_with_parent
from gateway.rls.tls import tls_context
from gateway.scratch_dirs import remove as remove_scratch_dir
from gateway.scratch_dirs import scratch_dir
from gateway.settings import Settings, announce_supervision
from gateway.which_redis import needs_embedded_redis

if TYPE_CHECKING:
    from gateway.app import Composed

WorkerMain = Callable[[Settings, list[socket.socket], Config], None]

log = logging.getLogger("gateway")

# A worker whose supervisor died stops accepting at once and is ended this long after, in flight or not.
ORPHAN_GRACE = 1.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def file_stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def rls_stamps(config: Config) -> tuple[tuple[int, int, int] | None, ...]:
    return tuple(file_stamp(path) for path in config.rls_files)


class Supervisor:
    def __init__(self, settings: Settings, config: Config, stamp: tuple[int, int, int] | None = None,
                 worker: WorkerMain | None = None) -> None:
        self.settings = settings
        self.worker = worker or worker_main  # a module-level function: the spawned process imports it
        self.config = config
        self.stamp = stamp or file_stamp(settings.config_path)  # the file as `config` was read from it
        self.rls_stamps = rls_stamps(config)  # ... and the envoyproxy/ratelimit files it names
        self.workers: list[BaseProcess] = []
        self.stopping = False
        self.reload_requested = False
        self.redis: EmbeddedRedis | None = None
        self.metrics_dir = scratch_dir("gateway-metrics-")

    def run(self) -> int:
        settings = self.settings
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        announce_supervision(self.metrics_dir)
        ports = [("proxy", "--port", settings.host, settings.port),
                 ("admin", "--admin-port", settings.effective_admin_host, settings.admin_port)]
        if settings.check_port is not None:
            ports.append(("check", "--check-port", settings.host, settings.check_port))
        if settings.rls_port is not None:  # last: the worker serves it beside uvicorn (run_worker)
            ports.append(("RLS", "--rls-port", settings.host, settings.rls_port))
        sockets: list[socket.socket] = []
        for name, flag, host, port in ports:
            try:
                sockets.append(bind(host, port))
            except OSError as exc:
                log.error("cannot listen on the %s port, %s: %s (%s picks another)",
                          name, format_address(host, port), exc.strerror or exc, flag)
                for sock in sockets:
                    sock.close()
                remove_scratch_dir(self.metrics_dir)
                return 1
        if needs_embedded_redis(settings, self.config):
            try:
                self.redis, settings = start_embedded(settings, die_with_parent=True)
            except (OSError, RuntimeError) as exc:
                log.error("cannot start the embedded redis-server: %s", exc)
                for sock in sockets:
                    sock.close()
                remove_scratch_dir(self.metrics_dir)
                return 1
            self.settings = settings
        elif settings.data_dir is not None:
            log.warning("--data-dir %s is ignored: a Redis URL is configured, and that Redis keeps the state",
                        settings.data_dir)
        context = multiprocessing.get_context("spawn")
        check = f", check endpoint {settings.host}:{settings.check_port}" if settings.check_port is not None else ""
        if settings.rls_port is not None:
            check += f", rate limit service (gRPC) {settings.host}:{settings.rls_port}"
        log.info("gateway on %s:%d (admin %s:%d%s), %d worker(s), config %s",
                 settings.host, settings.port, settings.effective_admin_host,
                 settings.admin_port, check, settings.workers, settings.config_path)
        for _ in range(settings.workers):
            self.workers.append(self._spawn(context, sockets))
        stamp = self.stamp
        # a signal writes a byte here, so the loop acts on it at once instead of after its nap
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        try:
            while not self.stopping:
                select.select([wake_r], [], [], settings.watch_interval if settings.watch_interval > 0 else 1.0)
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                current = file_stamp(settings.config_path)
                if settings.watch_interval > 0 and current != stamp and current is not None:
                    stamp = current
                    log.info("%s changed on disk: reloading", settings.config_path)
                    self.reload_requested = True
                elif settings.watch_interval > 0 and rls_stamps(self.config) != self.rls_stamps:
                    self.rls_stamps = rls_stamps(self.config)
                    log.info("a file of rls.files changed on disk: reloading")
                    self.reload_requested = True
                if self.reload_requested:
                    self.reload_requested = False
                    self._remember_good_config()
                    self._signal_workers(signal.SIGHUP)
                self._replace_dead(context, sockets)
        finally:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
            self._shutdown()
            for sock in sockets:
                sock.close()
        return 0

    def _spawn(self, context: multiprocessing.context.SpawnContext, sockets: list[socket.socket]) -> BaseProcess:
        # A new worker starts from the last config that loaded, whatever the file holds now, and
        # with SIGHUP blocked (the mask survives exec): a reload asked for while it starts waits
        # until its handler is in place instead of killing it.
        process = context.Process(target=self.worker, args=(self.settings, sockets, self.config), daemon=False)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return process

    def _remember_good_config(self) -> None:
        """Workers validate and report a reload themselves; the supervisor keeps the last good
        config so that a worker started later (a crashed one replaced) does not fail on a bad file."""
        with contextlib.suppress(ConfigError):
            self.config = load_config(self.settings.config_path, decision_only=self.settings.decision_only)
        self.rls_stamps = rls_stamps(self.config)

    def _replace_dead(self, context: multiprocessing.context.SpawnContext, sockets: list[socket.socket]) -> None:
        from gateway.metrics import mark_worker_dead

        for i, process in enumerate(self.workers):
            if not process.is_alive() and not self.stopping:
                log.error("worker %s exited with %s; starting a new one", process.pid, process.exitcode)
                if process.pid is not None:
                    mark_worker_dead(process.pid)
                self.workers[i] = self._spawn(context, sockets)

    def _signal_workers(self, sig: int) -> None:
        for process in self.workers:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.reload_requested = True

    def _shutdown(self) -> None:
        self.stopping = True
        log.info("shutting down: draining in-flight requests (at most %.0fs)", self.settings.drain_timeout)
        self._signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout + 5
        for process in self.workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join()
        if self.redis is not None:
            self.redis.stop()
            log.info("embedded redis-server stopped")
        remove_scratch_dir(self.metrics_dir)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    access = logging.getLogger("gateway.access")
    access.propagate = False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)


def stop_with_supervisor() -> None:
    """In every worker before it serves: when the supervisor dies, by any signal, the kernel sends
    SIGUSR1 (a supervisor gone already is caught by the pid check: the worker exits)."""
    supervisor = multiprocessing.parent_process()
    pid = supervisor.pid if supervisor is not None else None
    assert pid is not None, "a worker is started by the supervisor"
    signal.signal(signal.SIGUSR1, _supervisor_gone)
    die_with_parent(signal.SIGUSR1, pid)


def _supervisor_gone(signum: int, frame: FrameType | None) -> None:
    log.error("the supervisor is gone: stopping (in-flight requests are cut after %.1fs)", ORPHAN_GRACE)
    # SIGALRM's default action ends the process if the drain outlasts the grace
    signal.setitimer(signal.ITIMER_REAL, ORPHAN_GRACE)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's shutdown: the listening sockets close first


def worker_main(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    """One worker: the gateway's application on its own HTTP protocol and upstream transport."""
    from gateway.app import compose

    configure_logging(settings.log_level)
    composed = compose(settings, config)
    run_worker(settings, sockets, composed, server_config(settings, composed))


def server_config(settings: Settings, composed: Composed) -> uvicorn.Config:
    """uvicorn's config serving `composed` on the gateway's own protocol, its hooks and bounds given."""
    from gateway.http.server import ServerConfig, ServerOptions

    options = ServerOptions(max_header_bytes=settings.max_head_bytes, header_timeout=settings.header_timeout,
                            send_timeout=settings.send_timeout,
                            early_answer=composed.endpoint.answer_early, doors=composed.doors)
    return ServerConfig(composed.app, options, **uvicorn_options(settings))


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What every worker asks of uvicorn, whichever HTTP protocol it serves with."""
    return {
        "loop": "uvloop",
        "ws": "none",
        "lifespan": "on",
        "log_config": None,
        "log_level": settings.log_level,
        "access_log": False,
        "proxy_headers": False,
        "server_header": False,
        "date_header": False,
        "timeout_graceful_shutdown": int(settings.drain_timeout),
        "timeout_keep_alive": 15,
    }


def run_worker(settings: Settings, sockets: list[socket.socket], composed: Composed,
               server_config: uvicorn.Config) -> None:
    """Serve `composed` on the inherited sockets until SIGTERM; SIGHUP reloads its config; stop at
    once if the supervisor dies."""
    stop_with_supervisor()
    lifecycle = composed.lifecycle
    rls_socket = sockets[-1] if settings.rls_port is not None else None
    http_sockets = sockets[:-1] if rls_socket is not None else sockets
    rls = composed.rls_server

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lifecycle.reload)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # blocked since the spawn
            await super().startup(sockets=sockets)
            if rls is not None and rls_socket is not None and self.started:
                tls = None
                if settings.rls_tls_cert is not None and settings.rls_tls_key is not None:
                    tls = tls_context(settings.rls_tls_cert, settings.rls_tls_key)
                await rls.start(rls_socket, tls)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if rls is not None:  # GOAWAY; the calls in flight answered before the runtime closes
                await rls.stop(settings.drain_timeout)
            await super().shutdown(sockets=sockets)

    uvicorn_server = Server(server_config)
    uvicorn_server.run(sockets=http_sockets)
    if not uvicorn_server.started:
        sys.exit(3)
