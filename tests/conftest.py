"""Real Redis servers for the suite. No fakes, no skips: a missing binary is an error."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import machine, patience
from tests.support.cluster import RedisCluster
from tests.support.redis_proc import RedisClock, RedisProcess, binaries
from tests.support.upstream import Upstream
from tests.support.windows import clear_of_the_edge

os.environ.setdefault("TZ", "UTC")


# The suite's slices (`make test-fast` runs the first): in-process tests against a real Redis; tests
# that start gateway processes (and the upstreams, apps and servers they need); Redis Cluster,
# Sentinel and the front proxies (nginx, Caddy, Envoy). A module's slice is read from what it uses,
# so a new test file lands in its slice without a list to keep.
SLICES = ("inprocess", "processes", "cluster_and_proxies")


def _slice(item: pytest.Item) -> str:
    from tests.support import front_proxies, gateway_proc, orphans, sentinel

    names = set(getattr(item, "fixturenames", ()))
    modules = {getattr(item, "module", None)}
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info is not None else ()):
        modules.update(sys.modules.get(d.func.__module__) for d in definitions)  # its fixtures' modules too
    modules -= {None, sys.modules[__name__]}  # this file's fixtures count by their names, below
    used = {id(value) for module in modules for value in vars(module).values()}
    heavy = (RedisCluster, sentinel.Sentinel, sentinel.sentinel_topology, front_proxies.FrontProxy,
             front_proxies.NginxAuthRequest, front_proxies.CaddyForwardAuth, front_proxies.EnvoyExtAuthz,
             front_proxies.envoy_binary)
    if "cluster" in names or used & {id(thing) for thing in heavy}:
        return "cluster_and_proxies"
    starts = (gateway_proc.GatewayProcess, orphans.started, Upstream, subprocess)
    if "upstream" in names or used & {id(thing) for thing in starts}:
        return "processes"
    return "inprocess"


def pytest_configure(config: pytest.Config) -> None:
    patience.factor()  # measured once, before any test loads the machine; carried to child processes
    for name in SLICES:
        config.addinivalue_line("markers", f"{name}: a slice of the suite (tests/conftest.py)")
    config.addinivalue_line("markers", "clock_windows: counts under windows aligned to the clock; starts the test "
                            "clear of a minute's edge (tests/support/windows.py)")
    config.addinivalue_line("markers", "alone: loads the machine on purpose and judges what it sees under that "
                            "load; no other test runs beside its load (tests/support/machine.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, _slice(item)))


def pytest_report_header(config: pytest.Config) -> str:
    return f"time factor: {patience.factor()} ({patience.ENV}; tests/support/patience.py)"


@pytest.fixture(autouse=True)
def _clear_of_a_minutes_edge(request: pytest.FixtureRequest) -> None:
    """A test marked `clock_windows` (counting under a fixed window of a minute or more, or an RLS
    unit, aligned to the clock) starts at least 2 s (scaled) before a minute turns
    (tests/support/windows.py); no other test waits."""
    if request.node.get_closest_marker("clock_windows") is not None:
        clear_of_the_edge(60.0)


@pytest.fixture(autouse=True)
def _a_share_of_the_machine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test holds a share of the machine while it runs, but one marked `alone`: that one takes
    the machine to itself while its load runs (tests/support/machine.py)."""
    machine.SHARED = tmp_path_factory.getbasetemp().parent
    if request.node.get_closest_marker("alone") is not None:
        yield
        return
    with machine.a_share():
        yield


@pytest.fixture(scope="session")
def redis_proc() -> Iterator[RedisProcess]:
    """One Redis 6.2 (the pip-shipped server) for the whole session; tests use distinct keys."""
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session", params=sorted(binaries()))
def any_redis(request: pytest.FixtureRequest) -> Iterator[RedisProcess]:
    """Each installed Redis version in turn (6.2 from pip, 7 from Debian)."""
    proc = RedisProcess(binaries()[request.param])
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def clocked_redis(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisClock]]:
    """A pip-shipped redis-server whose clock the test sets (libfaketime, absolute time)."""
    clock = RedisClock(tmp_path / "clock")
    proc = RedisProcess(clock_file=clock.path)
    proc.start()
    yield proc, clock
    proc.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A three-primary Redis Cluster of real processes, one per test module (modules move slots)."""
    c = RedisCluster()
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    """A real HTTP upstream (tests/support/upstream.py) for the whole session."""
    server = Upstream()
    server.start()
    yield server
    server.stop()
