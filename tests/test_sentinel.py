"""Sentinel: a real primary, a real replica and a real sentinel. A failover costs no decision an
error: the gateway asks the sentinel again and carries on with the new primary."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import RedisSettings, Rule
from gateway.errors import RedisUnavailable
from gateway.keys import state_key
from gateway.limiter import Limiter, rule_spec
from gateway.redis import Runner, SentinelRunner, make_runner
from tests.support.patience import within
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.sentinel import Sentinel, sentinel_topology
from tests.support.waiting import wait_until


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisProcess, Sentinel]]:
    with sentinel_topology(tmp_path) as processes:
        yield processes


def _primary_port(sentinel: Sentinel) -> int:
    _host, port = sentinel.client().execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
    return int(port)


def _switched(sentinel: Sentinel) -> int:
    """The primary's port in SENTINEL MASTERS (what redis-py reads), which names the new primary
    only once the failover is complete (get-master-addr-by-name does earlier)."""
    state: Any = sentinel.client().sentinel_master("mymaster")
    return int(state["port"])


def test_decisions_survive_a_failover(topology: tuple[RedisProcess, RedisProcess, Sentinel]) -> None:
    _primary, replica, sentinel = topology
    settings = RedisSettings(url=f"redis://127.0.0.1:{sentinel.port}", mode="sentinel", timeout=1.0,
                             sentinel_master="mymaster")
    rule = Rule("stock", (), "quota", limit=10)
    key = state_key("rlgw", "sale", "stock", "~")

    async def run() -> list[bool]:
        runner = make_runner(settings)
        limiter = Limiter(runner)
        try:
            return await decisions(limiter, runner)
        finally:
            await limiter.close()

    async def decisions(limiter: Limiter, runner: Runner) -> list[bool]:
        admitted = [(await limiter.decide([rule_spec(rule)], [key], [1])).admitted for _ in range(4)]
        wait_until(lambda: replica.client().get(key) == b"4")
        sentinel.client().execute_command("SENTINEL", "FAILOVER", "mymaster")
        wait_until(lambda: _primary_port(sentinel) == replica.port, timeout=20)
        wait_until(lambda: replica.client().info("replication")["role"] == "master", timeout=20)
        # writes between the promotion and the runner's next look at the sentinels go to the old
        # primary and are lost when it is demoted (asynchronous replication); the runner looks
        # every check_interval seconds, on a decision (a peek counts nothing)
        assert isinstance(runner, SentinelRunner)
        pool: Any = runner.client.connection_pool
        deadline = time.monotonic() + within(SentinelRunner.check_interval + 10)
        while pool.master_address != ("127.0.0.1", replica.port):
            assert time.monotonic() < deadline, f"the runner still sends to {pool.master_address}"
            await limiter.decide([rule_spec(rule)], [key], [0], peek=True)  # triggers the look
            await asyncio.sleep(0.1)
        errors = 0
        for _ in range(8):
            try:
                admitted.append((await limiter.decide([rule_spec(rule)], [key], [1])).admitted)
            except RedisUnavailable:
                errors += 1
        assert errors == 0
        return admitted

    assert asyncio.run(run()) == [True] * 10 + [False] * 2
    assert replica.client().get(key) == b"10"


def test_no_sentinel_answering_is_redis_unavailable(tmp_path: Path) -> None:
    settings = RedisSettings(url=f"redis://127.0.0.1:{free_port()}", mode="sentinel", timeout=0.2,
                             sentinel_master="mymaster")

    async def run() -> None:
        limiter = Limiter(make_runner(settings))
        with pytest.raises(RedisUnavailable):
            await limiter.decide([rule_spec(Rule("q", (), "quota", limit=1))], ["rlgw:{x}:q:~"], [1])
        await limiter.close()

    asyncio.run(run())


def test_readonly_from_a_demoted_primary_leads_to_the_new_one(
    topology: tuple[RedisProcess, RedisProcess, Sentinel],
) -> None:
    """The pooled connection still reaches the old primary when it is demoted (before the periodic
    look at the sentinels): its READONLY reply makes the batch go again, to the new primary."""
    primary, replica, sentinel = topology
    settings = RedisSettings(url=f"redis://127.0.0.1:{sentinel.port}", mode="sentinel", timeout=1.0,
                             sentinel_master="mymaster")
    rule = Rule("stock", (), "quota", limit=10)
    key = state_key("rlgw", "readonly", "stock", "~")

    async def run() -> list[bool]:
        runner = make_runner(settings)
        assert isinstance(runner, SentinelRunner)
        runner.check_interval = 3600.0  # only READONLY can tell it
        limiter = Limiter(runner)
        try:
            return await decisions(limiter)
        finally:
            await limiter.close()

    async def decisions(limiter: Limiter) -> list[bool]:
        admitted = [(await limiter.decide([rule_spec(rule)], [key], [1])).admitted for _ in range(4)]
        wait_until(lambda: replica.client().get(key) == b"4")
        sentinel.client().execute_command("SENTINEL", "FAILOVER", "mymaster")
        wait_until(lambda: _primary_port(sentinel) == replica.port, timeout=20)
        wait_until(lambda: replica.client().info("replication")["role"] == "master", timeout=20)
        # the switch is complete (SENTINEL MASTERS, which redis-py reads, names the new primary too)
        wait_until(lambda: _switched(sentinel) == replica.port, timeout=20)
        primary.client().replicaof("127.0.0.1", replica.port)  # demoted, as Sentinel will do too
        wait_until(lambda: primary.client().info("replication")["master_link_status"] == "up", timeout=20)
        errors = 0
        for _ in range(8):
            try:
                admitted.append((await limiter.decide([rule_spec(rule)], [key], [1])).admitted)
            except RedisUnavailable:
                errors += 1
        assert errors == 0
        return admitted

    assert asyncio.run(run()) == [True] * 10 + [False] * 2
    assert replica.client().get(key) == b"10"
