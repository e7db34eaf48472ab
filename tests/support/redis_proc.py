"""Real redis-server processes for the tests: the pip-shipped 6.2 and Debian's 7, optionally with
libfaketime preloaded so a test can move the server's clock forwards and backwards."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import redis

from gateway.embedded import EmbeddedRedis, redis_server_binary
from tests.support.orphans import dying
from tests.support.patience import within
from tests.support.ports import free_port

DEBIAN_REDIS = "/usr/bin/redis-server"
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
)


def binaries() -> dict[str, str]:
    """Every server version the suite runs against. Debian's is installed by `make system-deps`."""
    found = {"6.2": redis_server_binary()}
    if Path(DEBIAN_REDIS).exists():
        found["7"] = DEBIAN_REDIS
    return found


def faketime_lib() -> str:
    for candidate in FAKETIME_LIBS:
        if Path(candidate).exists():
            return candidate
    raise RuntimeError("libfaketime is missing: run `make system-deps` (Debian package faketime)")


class RedisProcess(EmbeddedRedis):
    """A redis-server on a free TCP port; `client()` gives a plain redis-py client to inspect it."""

    def __init__(self, binary: str | None = None, clock_file: Path | None = None,
                 extra_args: tuple[str, ...] = (), port: int | None = None) -> None:
        env = None
        if clock_file is not None:
            env = {
                "LD_PRELOAD": faketime_lib(),
                "FAKETIME_TIMESTAMP_FILE": str(clock_file),
                "FAKETIME_NO_CACHE": "1",
            }
        super().__init__(binary=binary, port=port or free_port(), extra_args=extra_args, env=env)

    def start(self, wait: float = 10.0) -> None:
        self.launcher = dying([])  # dies with the test run (tests/support/orphans.py)
        super().start(within(wait))

    def stop(self) -> None:
        if self.env and self.process is not None and self.process.poll() is None:
            self.process.kill()  # with a frozen clock a graceful shutdown waits for time to pass
            self.process.wait()
        super().stop()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def restart(self) -> None:
        """Stop and start again on the same port, with empty memory."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None
        self.start()


class RedisClock:
    """Drives a faketime'd redis-server's clock: frozen at absolute timestamps written to its clock file."""

    def __init__(self, path: Path, start: float | None = None) -> None:
        self.path = path
        self.now = float(int(start if start is not None else time.time()))
        self.set(self.now)

    def set(self, when: float) -> None:
        self.now = when
        seconds, micros = divmod(round(when * 1_000_000), 1_000_000)  # exact to the microsecond
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))
        frac = f".{micros:06d}5"  # libfaketime parses a double and truncates: aim mid-microsecond
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{stamp}{frac}\n")  # no "@": the clock stands still until set
        os.replace(tmp, self.path)

    def advance(self, seconds: float) -> None:
        self.set(self.now + seconds)


def have_faketime() -> bool:
    return shutil.which("faketime") is not None
