"""protect: scope fleet: one in-flight limit for every gateway in front of an upstream, held in Redis.
Real gateway processes (two, sharing one Redis), a real upstream that counts the requests it holds."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import struct
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import Priority, Protect, RedisSettings
from gateway.keys import protect_keys
from gateway.limiter import Limiter
from gateway.protect import Fleet, Guard
from gateway.redis import make_runner
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

LIMIT = 4
FLEET = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up:
    url: "{upstream}"
    timeout: 90s
    protect:
      scope: {scope}
      lease: {lease}
      min_limit: {limit}
      max_limit: {limit}
      priorities:
        - {{name: critical, match: {{headers: {{x-priority: critical}}}}}}
        - {{name: sheddable, share: {share}}}
routes:
  - {{name: held, match: {{path: /inflight}}, upstream: up, failure_mode: {failure_mode}}}
"""


@pytest.fixture
def upstream_own() -> Iterator[Upstream]:
    upstream = Upstream()  # its own: the in-flight count starts at zero
    upstream.start()
    yield upstream
    upstream.stop()


class Gateways:
    """Gateway processes of one configuration, sharing one Redis and key prefix."""

    def __init__(self, tmp_path: Path, redis_url: str, upstream: Upstream, **values: object) -> None:
        settings: dict[str, object] = {"scope": "fleet", "lease": "60s", "limit": LIMIT, "share": 100,
                                       "failure_mode": "open", **values}
        self.prefix = f"f{uuid.uuid4().hex[:8]}"
        self.text = FLEET.format(prefix=self.prefix, upstream=upstream.url, **settings)
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.procs: list[GatewayProcess] = []

    def start(self) -> GatewayProcess:
        workdir = self.tmp_path / uuid.uuid4().hex[:6]
        workdir.mkdir()
        proc = GatewayProcess(self.text, workdir, redis_url=self.redis_url)
        proc.start()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def gateways(tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> Iterator[Callable[..., Gateways]]:
    made: list[Gateways] = []

    def make(**values: object) -> Gateways:
        found = Gateways(tmp_path, redis_proc.url, upstream_own, **values)
        made.append(found)
        return found

    yield make
    for found in made:
        found.stop()


class Held:
    """A request the upstream holds for a minute (unless the gateway refuses it): its socket stays open."""

    def __init__(self, proc: GatewayProcess, priority: str = "sheddable") -> None:
        self.sock = socket.create_connection(("127.0.0.1", proc.port))
        self.sock.sendall(b"GET /inflight?delay=60 HTTP/1.1\r\nHost: a\r\nX-Priority: %s\r\n\r\n" % priority.encode())

    def status(self) -> int | None:
        """The gateway's answer's status; None while none has come (the upstream holds the request)."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return None
        head = self.sock.recv(65536, socket.MSG_PEEK)
        return int(head.split()[1]) if head else 0

    def close(self) -> None:
        self.sock.close()


def at_upstream(upstream: Upstream) -> dict[str, int]:
    return dict(httpx.get(upstream.url + "/inflight-max").json())


def offer(procs: list[GatewayProcess], upstream: Upstream, each: int) -> tuple[list[Held], int]:
    """`each` held requests to every gateway, in turns; once each was refused or reached the upstream: them,
    and how many the upstream holds (the upstream finishes a request its client left only after its minute)."""
    before = at_upstream(upstream)["now"]
    held = [Held(proc) for _ in range(each) for proc in procs]

    def admitted() -> int:
        return at_upstream(upstream)["now"] - before

    wait_until(lambda: admitted() + sum(h.status() is not None for h in held) == len(held))
    return held, admitted()


@pytest.mark.parametrize(("scope", "most"), [("fleet", LIMIT), ("worker", 2 * LIMIT)])
def test_two_gateways_with_scope_fleet_admit_one_limit_between_them(
        gateways: Callable[..., Gateways], upstream_own: Upstream, scope: str, most: int) -> None:
    fleet = gateways(scope=scope)
    procs = [fleet.start(), fleet.start()]
    held, admitted = offer(procs, upstream_own, each=3 * LIMIT)
    try:
        # fleet: the two together admit one limit, the rest refused; worker: each admits a limit of its own
        assert admitted == most and at_upstream(upstream_own)["most"] == most
        refused = [h.status() for h in held if h.status() is not None]
        assert refused == [503] * (len(held) - most)
    finally:
        for h in held:
            h.close()
    # the clients left: their slots are given back, in Redis too, and the fleet admits again
    wait_until(lambda: all(httpx.get(p.url + "/inflight", params={"delay": 0}).status_code == 200 for p in procs))


def test_priorities_are_shed_by_the_fleets_count(gateways: Callable[..., Gateways], upstream_own: Upstream) -> None:
    fleet = gateways(share=50)
    one, two = fleet.start(), fleet.start()
    held = [Held(one), Held(one)]  # sheddable requests fill their 50% of the limit of 4, through one gateway
    try:
        wait_until(lambda: at_upstream(upstream_own)["now"] == 2)
        refused = httpx.get(two.url + "/inflight", params={"delay": 0})  # ... so the other gateway sheds the next
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["priority"] == "sheddable" and refused.json()["route"] == "held"
        critical = httpx.get(two.url + "/inflight", params={"delay": 0}, headers={"x-priority": "critical"})
        assert critical.status_code == 200, critical.text
    finally:
        for h in held:
            h.close()


def test_a_gateway_that_dies_gives_its_slots_back_when_their_lease_runs_out(
        gateways: Callable[..., Gateways], upstream_own: Upstream, redis_proc: RedisProcess) -> None:
    fleet = gateways(lease="1s")
    dying, alive = fleet.start(), fleet.start()
    held, _ = offer([dying], upstream_own, each=LIMIT)
    client = redis_proc.client()
    try:
        slots = f"{fleet.prefix}:{{~protect:up:*}}:slots"
        leases: list[tuple[bytes, float]] = client.zrange(slots, 0, -1, withscores=True)  # type: ignore[assignment]
        first = max(score for _, score in leases)
        # alive, the holder renews its leases: once Redis's clock is past their first expiry they still hold
        wait_until(lambda: _redis_now_us(client) > first)
        assert httpx.get(alive.url + "/inflight", params={"delay": 0}).status_code == 503
        assert client.zcard(slots) == LIMIT
        assert dying.process is not None
        os.killpg(dying.process.pid, signal.SIGKILL)  # no give-back: its slots run out with their lease
        wait_until(lambda: httpx.get(alive.url + "/inflight", params={"delay": 0}).status_code == 200)
    finally:
        for h in held:
            h.close()


def test_clients_that_leave_as_soon_as_they_have_asked_hold_no_fleet_slot(
        gateways: Callable[..., Gateways], upstream_own: Upstream, redis_proc: RedisProcess) -> None:
    """Leaving while the take is at Redis: Redis takes the slot anyway, and the request's task,
    cancelled, never learnt of it: the slot stayed taken for its whole lease, and the fleet answered
    503 with nothing in flight (an outside probe)."""
    fleet = gateways()
    proc = fleet.start()
    for _ in range(40):
        sock = socket.create_connection(("127.0.0.1", proc.port))
        sock.sendall(b"GET /inflight?delay=60 HTTP/1.1\r\nHost: a\r\n\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    slots = f"{fleet.prefix}:{{~protect:up:*}}:slots"
    client = redis_proc.client()
    try:  # every slot back as soon as its request ends (the lease is a minute)
        wait_until(lambda: client.zcard(slots) == 0, timeout=5)
    except TimeoutError:
        raise AssertionError(f"{client.zcard(slots)} of {LIMIT} fleet slots held with nothing in flight") from None
    assert httpx.get(proc.url + "/inflight", params={"delay": 0}).status_code == 200


def _redis_now_us(client: object) -> int:
    seconds, micros = client.time()  # type: ignore[attr-defined]
    return int(seconds) * 1_000_000 + int(micros)


def _kill(redis: RedisProcess) -> None:
    """Redis gone at once, its port kept for `start()` (as tests/test_breaker_recovery.py does)."""
    assert redis.process is not None
    redis.process.kill()
    redis.process.wait()
    if redis.process.stderr:
        redis.process.stderr.close()
    redis.process = None


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


def test_redis_gone_failure_mode_closed_refuses_with_503(
        tmp_path: Path, own_redis: RedisProcess, upstream_own: Upstream) -> None:
    fleet = Gateways(tmp_path, own_redis.url, upstream_own, failure_mode="closed")
    proc = fleet.start()
    try:
        assert httpx.get(proc.url + "/inflight", params={"delay": 0}).status_code == 200
        _kill(own_redis)
        answer = httpx.get(proc.url + "/inflight", params={"delay": 0})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
        assert "rate limiting is unavailable" in answer.json()["detail"]
        assert at_upstream(upstream_own)["most"] == 1  # the refused request never reached the upstream
        assert "the fleet's limit is out of reach" in proc.log()
    finally:
        fleet.stop()


def test_redis_gone_failure_mode_open_counts_each_gateway_on_its_own_then_the_fleet_again(
        tmp_path: Path, own_redis: RedisProcess, upstream_own: Upstream) -> None:
    fleet = Gateways(tmp_path, own_redis.url, upstream_own)
    one, two = fleet.start(), fleet.start()
    held: list[Held] = []
    try:
        _kill(own_redis)
        # no Redis: each gateway admits the last limit it saw, counting its own requests
        held, admitted = offer([one, two], upstream_own, each=LIMIT + 1)
        assert admitted == 2 * LIMIT
        assert sorted(h.status() or 0 for h in held)[-2:] == [503, 503]
        for h in held:
            h.close()
        held = []
        own_redis.start()  # Redis back (empty): each gateway takes its slots there again, once its breaker closed
        wait_until(lambda: all(httpx.get(p.url + "/inflight", params={"delay": 0}).status_code == 200
                               and "Redis answers again; the fleet's limit applies" in p.log() for p in (one, two)))
        held, admitted = offer([one, two], upstream_own, each=LIMIT)
        assert admitted == LIMIT
    finally:
        for h in held:
            h.close()
        fleet.stop()


def test_the_fleet_steps_its_limit_once_a_window_and_probes_for_every_gateway(redis_proc: RedisProcess) -> None:
    protect = Protect((Priority("all", 1.0),), min_limit=2, max_limit=100, scope="fleet")
    prefix = f"s{uuid.uuid4().hex[:8]}"
    client = redis_proc.client()
    _, state = protect_keys(prefix, "up", "*")

    async def run() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=2.0)))
        one, two = (Guard(protect, "up", fleet=Fleet(limiter, prefix, "up", "*", 60.0)) for _ in range(2))
        try:
            assert one.fleet is not None and two.fleet is not None
            slot = await one.take(protect.priorities[0])  # the fleet starts from the first gateway's limit
            assert slot is not None and one.controller.limit == 10
            stepped = int(client.hget(state, "stepped") or 0)
            wait_until(lambda: _redis_now_us(client) > stepped + 100_000)  # a window of 100 ms has passed
            one.controller.limit = 20
            one.fleet.step(one.controller, 0.1, probe=False)
            await one.fleet.drain()
            assert one.controller.limit == 20
            # the other gateway's proposal within its window of that step is dropped; the fleet's limit comes back
            two.controller.limit = 5
            two.fleet.step(two.controller, 3600.0, probe=False)
            await two.fleet.drain()
            assert two.controller.limit == 20
            client.hset(state, "stepped", 0)  # as if the last step were long ago: the next proposal is taken
            two.fleet.step(two.controller, 3600.0, probe=True)  # its limit (20) and a probe for its window
            await two.fleet.drain()
            # every gateway admits half the limit while the probe lasts: 10 places, one of them taken above
            taken = [await g.take(protect.priorities[0]) for g in (one, two) * 6]
            assert [s is not None for s in taken] == [True] * 9 + [False] * 3
            for s in [slot, *taken]:
                if s is not None:
                    s.release()
            await one.drain()
            await two.drain()
        finally:
            await limiter.close()

    asyncio.run(run())
