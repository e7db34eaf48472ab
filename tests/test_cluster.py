"""Redis Cluster: three real primaries (six processes with their replicas for the failover). One
decision = one call to the node owning the route's hash tag; a slot that moves while the gateway
runs costs no decision an error, and no count (tests/test_cluster_resharding.py moves one under
load); a dead primary fails its decisions only until its replica is promoted."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import httpx
from redis.crc import key_slot

from gateway.config import RedisSettings, Rule, Source
from gateway.errors import RedisUnavailable
from gateway.keys import state_key
from gateway.limiter import Decision, Limiter, rule_spec
from gateway.redis import ClusterRunner, make_runner
from gateway.redis.connections import HiredisPacking
from tests.support.cluster import RedisCluster
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.upstream import Upstream


def test_key_slot_matches_redis(cluster: RedisCluster) -> None:
    client = cluster.nodes[0].client()
    for key in ["plain", "rlgw:{seckill}:user:alice", "{}x", "a{b}c{d}", "{{x}}", "é{ü}"]:
        assert key_slot(key.encode()) == client.execute_command("CLUSTER", "KEYSLOT", key)


def test_layered_decision_is_one_call_on_the_route_owner(cluster: RedisCluster) -> None:
    rules = [
        Rule("user", (Source("header", "x-user"),), "token_bucket", rate=1.0, burst=3),
        Rule("item", (Source("path", "item"),), "sliding_window", limit=1000, window=1.0),
        Rule("stock", (Source("path", "item"),), "quota", limit=4),
    ]
    routes = [f"r{i}" for i in range(6)]  # fixed names: their hash tags fall on all three primaries
    run_id = uuid.uuid4().hex[:6]  # fresh identities, so state left by another test never counts

    async def run() -> dict[str, list[bool]]:
        limiter = Limiter(make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=1.0)))
        out: dict[str, list[bool]] = {}
        for route in routes:
            out[route] = []
            for i in range(6):
                keys = [state_key("rlgw", route, "user", f"u{i}-{run_id}"),
                        state_key("rlgw", route, "item", f"42-{run_id}"),
                        state_key("rlgw", route, "stock", f"42-{run_id}")]
                decision = await limiter.decide([rule_spec(r) for r in rules], keys, [1, 1, 1])
                out[route].append(decision.admitted)
        await limiter.close()
        return out

    results = asyncio.run(run())
    owners = set()
    for route, admitted in results.items():
        assert admitted == [True] * 4 + [False] * 2
        owner = cluster.owner_of(state_key("rlgw", route, "stock", f"42-{run_id}"))
        owners.add(owner.port)
        assert owner.client().get(state_key("rlgw", route, "stock", f"42-{run_id}")) == b"4"
        assert owner.client().exists(state_key("rlgw", route, "user", f"u0-{run_id}")) == 1
    assert len(owners) > 1  # routes spread over the cluster


def _move_slot(cluster: RedisCluster, slot: int) -> None:
    """Migrate one slot, with its keys, from its owner to another primary (what resharding does)."""
    ids = {n.port: n.client().execute_command("CLUSTER", "MYID").decode() for n in cluster.nodes}
    source = next(n for n in cluster.nodes if any(
        s <= slot <= e and int(p[1]) == n.port for s, e, p, *_ in n.client().execute_command("CLUSTER", "SLOTS")))
    target = next(n for n in cluster.nodes if n.port != source.port)
    src, dst = source.client(), target.client()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    for node in cluster.nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])


def test_a_moved_slot_costs_no_error_and_no_count(cluster: RedisCluster) -> None:
    route = f"moving-{uuid.uuid4().hex[:6]}"
    key = state_key("rlgw", route, "stock", "~")
    rule = Rule("stock", (), "quota", limit=6)

    async def run() -> list[bool]:
        limiter = Limiter(make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=1.0)))
        admitted = [(await limiter.decide([rule_spec(rule)], [key], [1])).admitted for _ in range(3)]
        before = cluster.owner_of(key).port
        _move_slot(cluster, key_slot(key.encode()))
        assert cluster.owner_of(key).port != before
        admitted += [(await limiter.decide([rule_spec(rule)], [key], [1])).admitted for _ in range(5)]
        await limiter.close()
        return admitted

    assert asyncio.run(run()) == [True] * 6 + [False] * 2


def test_gateway_in_cluster_mode_end_to_end(cluster: RedisCluster, upstream: Upstream, tmp_path: Path) -> None:
    config = f"""
    version: 1
    redis: {{url: "{cluster.url}", mode: cluster, timeout: 500ms, key_prefix: c{uuid.uuid4().hex[:6]}}}
    upstreams: {{up: {{url: "{upstream.url}"}}}}
    routes:
      - name: sale
        match: {{path: "/echo/sale/{{item}}"}}
        upstream: up
        limits:
          - {{name: stock, by: [path:item], algorithm: quota, limit: 7}}
          - {{name: user, by: [header:X-User], algorithm: gcra, rate: 100/s, burst: 100}}
    """
    gateway = GatewayProcess(config, tmp_path, workers=2)
    gateway.start()
    try:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
                calls = [client.get("/echo/sale/9", headers={"X-User": f"u{i}"}) for i in range(30)]
                return [r.status_code for r in await asyncio.gather(*calls)]

        statuses = asyncio.run(burst())
        assert statuses.count(200) == 7
        assert statuses.count(429) == 23
    finally:
        assert gateway.stop() == 0


def test_a_primary_failover_fails_decisions_only_until_its_replica_takes_over() -> None:
    """Six processes: three primaries, a replica each. The primary of a route's slot is killed: its
    decisions fail (fast, never past redis.timeout) until Cluster promotes the replica, then the
    runner finds it and they carry on from the replica's copy of the state."""
    c = RedisCluster(replicas=1)
    c.start()
    try:
        route = f"failover-{uuid.uuid4().hex[:6]}"
        key = state_key("rlgw", route, "stock", "~")
        rule = [rule_spec(Rule("stock", (), "quota", limit=10_000))]
        victim = c.owner_of(key)
        replica = c.replica_of(victim)
        seed = next(n for n in c.nodes if n.port not in (victim.port, replica.port))
        timeout = 0.5

        async def run() -> tuple[int, list[tuple[float, bool]]]:
            limiter = Limiter(make_runner(RedisSettings(url=seed.url, mode="cluster", timeout=timeout)))
            for _ in range(20):
                assert (await limiter.decide(rule, [key], [1])).admitted
            assert victim.client().execute_command("WAIT", 1, 5000) == 1  # the replica has all 20
            assert victim.process is not None
            victim.process.kill()
            victim.process.wait()
            calls: list[tuple[float, bool]] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    await limiter.decide(rule, [key], [1])
                    calls.append((time.perf_counter() - started, True))
                except RedisUnavailable:
                    calls.append((time.perf_counter() - started, False))
                if len(calls) >= 20 and all(ok for _, ok in calls[-20:]):
                    break
                await asyncio.sleep(0.05)
            await limiter.close()
            return sum(ok for _, ok in calls), calls

        admitted_after, calls = asyncio.run(run())
        failed = sum(not ok for _, ok in calls)
        print(f"after the kill: {failed} failed, {admitted_after} admitted; slowest {max(t for t, _ in calls):.3f}s")
        assert all(ok for _, ok in calls[-20:])  # the replica took over and the runner found it
        assert max(t for t, _ in calls) < timeout + 0.1
        assert c.owner_of(key).port == replica.port
        assert replica.client().get(key) == str(20 + admitted_after).encode()  # no count lost
    finally:
        c.stop()


def test_ping_and_reset_reach_the_right_nodes(cluster: RedisCluster) -> None:
    keys = [state_key("rlgw", f"r{i}", "stock", f"reset-{uuid.uuid4().hex[:6]}") for i in range(6)]
    rule = [rule_spec(Rule("stock", (), "quota", limit=1))]

    async def run() -> list[tuple[bool, bool, bool]]:
        runner = make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=1.0))
        assert isinstance(runner, ClusterRunner)
        limiter = Limiter(runner)
        await limiter.ping()
        # every node's connections pack commands with hiredis, as in the other modes
        assert all(issubclass(node.connection_class, HiredisPacking) for node in runner.cluster.get_nodes())
        out = []
        for key in keys:  # on all three primaries
            assert (await limiter.decide(rule, [key], [1])).admitted
            refused = not (await limiter.decide(rule, [key], [1])).admitted
            out.append((refused, await limiter.reset(key), (await limiter.decide(rule, [key], [1])).admitted))
        await limiter.close()
        return out

    assert asyncio.run(run()) == [(True, True, True)] * len(keys)


def test_a_hung_primary_holds_back_only_its_own_slots(cluster: RedisCluster) -> None:
    """One primary stops answering (SIGSTOP: a partition, a stalled disk). Decisions on its slots
    fail within redis.timeout and then its slots' breakers open; decisions on the other primaries,
    sent in the same batches, are answered and counted as ever: one node is not the whole
    gateway's outage. When it answers again, so do its slots."""
    run_id = uuid.uuid4().hex[:6]
    keys: dict[int, str] = {}
    for i in range(64):  # one key on each primary
        key = state_key("rlgw", f"hung{i}-{run_id}", "stock", "~")
        keys.setdefault(cluster.owner_of(key).port, key)
        if len(keys) == 3:
            break
    victim = cluster.owner_of(next(iter(keys.values())))
    hung, healthy = keys[victim.port], [k for port, k in keys.items() if port != victim.port]
    rule = [rule_spec(Rule("stock", (), "quota", limit=1000))]

    async def run() -> tuple[list[object], list[str], str, bool]:
        limiter = Limiter(make_runner(RedisSettings(url=cluster.url, mode="cluster", timeout=within(1.0))))
        try:
            return await hang_and_resume(limiter)
        finally:
            await limiter.close()

    async def hang_and_resume(limiter: Limiter) -> tuple[list[object], list[str], str, bool]:
        for key in keys.values():
            assert (await limiter.decide(rule, [key], [1])).admitted
        assert victim.process is not None
        victim.process.send_signal(signal.SIGSTOP)
        try:
            admitted: list[object] = []  # True, or what a healthy decision got instead
            failures: list[str] = []
            for _ in range(limiter.breaker.failures_to_open + 3):
                answers = await asyncio.gather(*(limiter.decide(rule, [k], [1]) for k in [hung, *healthy]),
                                               return_exceptions=True)
                failure = answers[0]
                failures.append(failure.kind if isinstance(failure, RedisUnavailable) else repr(failure))
                admitted += [True if isinstance(a, Decision) and a.admitted else a for a in answers[1:]]
            state = limiter.breaker_state.name
        finally:
            victim.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + within(10)
        back = False
        while not back and time.monotonic() < deadline:
            try:
                back = (await limiter.decide(rule, [hung], [1])).admitted
            except RedisUnavailable:
                await asyncio.sleep(0.1)
        return admitted, failures, state, back

    admitted, failures, state, back = asyncio.run(run())
    assert admitted == [True] * 2 * (5 + 3), f"the other primaries' decisions were answered: {admitted}"
    assert failures[:5] == ["timeout"] * 5 and set(failures[5:]) == {"breaker_open"}, failures
    assert state == "OPEN", "healthz and the metrics show an open breaker"
    assert back, "the hung primary's slots answer again once it does"
    for key in healthy:
        assert cluster.client_for(key).get(key) == b"9", "each healthy decision counted once"
