"""One worker's configuration over its life: start-up, reload, shutdown.

`Lifecycle` holds the Runtime in force (gateway/runtime.py) and swaps it on reload: the new file is
validated first and, if bad, the old config stays; requests hold the Runtime they started with,
and the old one closes what the new one does not reuse once its last request has finished. The
admin port (gateway/admin/) reads and reloads through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from gateway import metrics, reload_log
from gateway.config import Config, load_config
from gateway.embedded import EmbeddedRedis, start_embedded
from gateway.errors import ConfigError, RedisUnavailable
from gateway.limiter import Limiter
from gateway.override_sync import Overrides, keep_in_step
from gateway.runtime import Runtime, build_runtime, new_limiter
from gateway.settings import Settings, metrics_dir
from gateway.top import TopRefused
from gateway.which_redis import needs_embedded_redis, redis_settings

log = logging.getLogger("gateway")

METRICS_FLUSH_INTERVAL = 1.0


class Lifecycle:
    """`proxy`: routes name their upstream (False: the in-process middleware, whose app is the
    upstream). `worker`: this process is a worker of `gateway serve`, its heap its own (False: the
    middleware, a guest in an application's process, leaves the collector as it found it)."""

    def __init__(self, settings: Settings, config: Config | None = None, transport: str = "lean",
                 proxy: bool = True, worker: bool = True) -> None:
        self.settings = settings
        self.initial_config = config
        self.transport = transport  # the upstream transport: "lean", or "httpx" for comparisons
        self.proxy = proxy
        self.worker = worker
        self.embedded: EmbeddedRedis | None = None  # started here when nothing else did (the middleware's)
        self.runtime: Runtime | None = None
        # the identities refused most, shared with the other workers through the metrics directory
        self.top = TopRefused(directory=metrics_dir())
        self.ready = False
        self._flusher: asyncio.Task[None] | None = None
        self.overrides = Overrides()  # per-identity overrides, kept in step with Redis
        self._syncer: asyncio.Task[None] | None = None
        self._reload_waiters: list[asyncio.Future[tuple[bool, str]]] = []
        self._reload_pending = False

    def current(self) -> Runtime | None:
        return self.runtime

    def _limiter(self, config: Config) -> Limiter:
        return new_limiter(redis_settings(self.settings, config))

    def _load(self) -> Config:
        return load_config(self.settings.config_path, proxy=self.proxy, decision_only=self.settings.decision_only)

    async def startup(self) -> None:
        config = self.initial_config or self._load()
        if needs_embedded_redis(self.settings, config) and not self.settings.embedded_redis_url:
            self.embedded, self.settings = await asyncio.get_running_loop().run_in_executor(
                None, start_embedded, self.settings)
        redis = redis_settings(self.settings, config)
        self.runtime = build_runtime(config, redis, self._limiter(config), transport=self.transport)
        metrics.CONFIG_INFO.set(len(config.routes))
        metrics.describe_rules(config.limited_routes)
        reload_log.note(True, f"started with {len(config.routes)} routes")
        self._flusher = asyncio.get_running_loop().create_task(self._flush_metrics())
        try:  # the overrides in force before the first request; Redis down: the poll catches up
            await self.overrides.sync(self.runtime)
        except RedisUnavailable as exc:
            log.warning("overrides not read at start-up, Redis unavailable (%s)", exc)
        self._syncer = asyncio.get_running_loop().create_task(keep_in_step(self.overrides, self.current))
        if self.worker:
            # What exists now lives as long as the worker: keep the collector from walking it again
            # and again (full collections paused every request in flight for ~30 ms).
            gc.collect()
            gc.freeze()
            gc.set_threshold(50_000, 20, 100)
        self.ready = True
        if self._reload_pending:
            self._reload_pending = False
            self.reload()

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_INTERVAL)
            metrics.flush()
            self.top.save()

    async def shutdown(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self._syncer is not None:
            self._syncer.cancel()
        metrics.flush()
        if self.runtime is not None:
            await self.runtime.close()
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    def reload(self) -> tuple[bool, str]:
        """Validate the file and swap it in; on any error the old config stays in force."""
        if self.runtime is None:  # asked before start-up finished: done once it has
            self._reload_pending = True
            return True, "deferred until start-up completes"
        try:
            result = self._reload()
        except Exception as exc:  # a reload must never take the worker down
            log.exception("reload failed, keeping the current config")
            metrics.RELOADS.labels("error").inc()
            result = False, f"reload failed: {exc.__class__.__name__}: {exc}"
        reload_log.note(*result)
        waiters, self._reload_waiters = self._reload_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(result)
        return result

    def next_reload(self) -> asyncio.Future[tuple[bool, str]]:
        """The outcome of this worker's next reload (one the supervisor passes on, say)."""
        waiter: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(waiter)
        return waiter

    def _reload(self) -> tuple[bool, str]:
        try:
            config = self._load()
        except ConfigError as exc:
            metrics.RELOADS.labels("error").inc()
            log.error("reload refused, keeping the current config:\n%s", exc)
            return False, str(exc)
        old = self.runtime
        assert old is not None
        redis = redis_settings(self.settings, config)
        limiter = old.limiter if redis == old.redis else self._limiter(config)
        new = build_runtime(config, redis, limiter, reuse=old.clients, transport=self.transport, guards=old.guards)
        self.overrides.apply(new)  # the overrides read so far, on the new rules, from its first request
        self.runtime = new
        metrics.RELOADS.labels("ok").inc()
        metrics.CONFIG_INFO.set(len(config.routes))
        metrics.describe_rules(config.limited_routes)
        log.info("reloaded %s: %d routes", self.settings.config_path, len(config.routes))
        asyncio.get_running_loop().create_task(self._retire(old, new))
        return True, f"{len(config.routes)} routes"

    async def _retire(self, old: Runtime, new: Runtime) -> None:
        old.retired = True
        if old.in_flight:
            await old.drained.wait()
        await old.close(successor=new)
