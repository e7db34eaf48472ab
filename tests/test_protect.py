"""Protecting the upstream (`protect:`): an adaptive limit on the requests in flight to an upstream
that sheds the least important first. Real gateway processes, Redis, and upstreams: one with a fixed
capacity (tests/support/capacity_upstream.py), whose answer time grows with its queue."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.support import machine
from tests.support.capacity_upstream import CapacityUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.overload import Stream, goodput, offer, percentile
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

CAPACITY = 4     # requests the upstream serves at once
SERVICE = 0.25   # seconds each takes: slow enough that the gateway's own time on a busy machine is small beside it
RATE = CAPACITY / SERVICE  # the upstream's capacity in requests a second

OVERLOAD = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  backend:
    url: "{upstream}"
    timeout: 30s
    {protect}
routes:
  - name: work
    match: {{path: /work}}
    upstream: backend
    limits:
      - {{name: everyone, by: [], algorithm: token_bucket, rate: 100000/s, burst: 100000}}
"""
PROTECT = """protect:
      latency: {target: 400ms, percentile: 90}
      priorities:
        - {name: critical, match: {headers: {x-priority: critical}}}
        - {name: sheddable}"""
CRITICAL = {"x-priority": "critical"}


@pytest.fixture(scope="module")
def backend() -> Iterator[CapacityUpstream]:
    upstream = CapacityUpstream(CAPACITY, SERVICE)
    upstream.start()
    yield upstream
    upstream.stop()


def gateway(tmp_path: Path, redis_proc: RedisProcess, config: str, **values: str) -> GatewayProcess:
    workdir = tmp_path / uuid.uuid4().hex[:6]
    workdir.mkdir()
    proc = GatewayProcess(config.format(prefix=f"p{uuid.uuid4().hex[:8]}", **values), workdir,
                          redis_url=redis_proc.url)
    proc.start()
    return proc


def unloaded_answer_time(url: str) -> float:
    """The median answer time of critical requests sent one at a time through the gateway."""
    with httpx.Client(timeout=10) as client:
        times = []
        for _ in range(20):
            started = time.perf_counter()
            assert client.get(url, headers=CRITICAL).status_code == 200
            times.append(time.perf_counter() - started)
    return percentile(times, 50)


@pytest.mark.alone  # its critical requests' answer time under the overload is judged against the unloaded one
def test_overload_sheds_sheddable_first_keeps_critical_fast_and_the_upstream_busy(
        tmp_path: Path, redis_proc: RedisProcess, backend: CapacityUpstream) -> None:
    proc = gateway(tmp_path, redis_proc, OVERLOAD, upstream=backend.url, protect=PROTECT)
    try:
        url = proc.url + "/work"
        overload, after = 12.0, within(5.0)
        with machine.to_itself():
            unloaded = unloaded_answer_time(url)
            run = asyncio.run(offer(url, [
                (overload, [Stream("sheddable", 3 * RATE), Stream("critical", 0.2 * RATE, CRITICAL)]),
                (after, [Stream("sheddable", 4.0)]),
            ], stats_url=backend.url + "/stats"))

        critical = run.of("critical")
        ok = [s for s in critical if s.status == 200]
        assert len(ok) >= 0.95 * len(critical), sorted({s.status for s in critical})
        assert percentile([s.seconds for s in ok], 90) <= 3 * unloaded, (unloaded, ok)
        # the upstream kept busy: at least 80% of its capacity served, once the limit has been found
        assert goodput(run, 2.0, overload) >= 0.8 * RATE, run.served
        shed = [s for s in run.of("sheddable", 0, overload) if s.status != 200]
        assert shed, "3x the capacity was offered: some sheddable requests must be refused"
        assert {(s.status, s.retry_after) for s in shed} == {(503, "1")}
        # when the overload ends, sheddable requests are admitted again within 5 s
        assert any(s.status == 200 for s in run.of("sheddable", overload, overload + after))
        log = proc.log()
        assert "shedding starts with priority 'sheddable'" in log and "shedding stops after" in log
        metrics = httpx.get(proc.admin_url + "/metrics").text
        assert re.search(r'gateway_protect_shed_total\{priority="sheddable",route="\*",upstream="backend"\} '
                         r'[1-9]', metrics), metrics
        assert 'gateway_protect_shed_total{priority="critical"' not in metrics or re.search(
            r'gateway_protect_shed_total\{priority="critical",route="\*",upstream="backend"\} 0\.0', metrics)
        assert "gateway_protect_limit{" in metrics and "gateway_protect_answer_time_seconds{" in metrics
    finally:
        assert proc.stop() == 0


COMPOSED = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up: {{url: "{upstream}", timeout: 30s}}
routes:
  - name: held
    match: {{path: /inflight}}
    upstream: up
    protect:
      min_limit: 2
      max_limit: 2
      priorities:
        - {{name: critical, match: {{headers: {{x-priority: critical}}}}}}
        - {{name: sheddable}}
    limits:
      - {{name: total, by: [], algorithm: quota, limit: 100}}
      - {{name: user, by: ["header:x-user"], algorithm: quota, limit: 2}}
"""


@pytest.fixture
def upstream_own() -> Iterator[Upstream]:
    upstream = Upstream()  # its own: the in-flight count starts at zero
    upstream.start()
    yield upstream
    upstream.stop()


def test_a_shed_request_costs_its_rules_nothing_and_a_refused_one_takes_no_place(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    proc = gateway(tmp_path, redis_proc, COMPOSED, upstream=upstream_own.url)
    url = proc.url + "/inflight"

    def in_flight() -> int:
        return int(httpx.get(upstream_own.url + "/inflight-max").json()["now"])

    try:
        with socket.create_connection(("127.0.0.1", proc.port)) as held:  # a sheddable request fills its share
            held.sendall(b"GET /inflight?delay=60 HTTP/1.1\r\nHost: a\r\nX-User: ann\r\n\r\n")
            wait_until(lambda: in_flight() == 1)
            for _ in range(5):
                refused = httpx.get(url, params={"delay": 0}, headers={"x-user": "bob"})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.headers["content-type"] == "application/problem+json"
                assert refused.json()["priority"] == "sheddable" and refused.json()["route"] == "held"
            # critical requests may fill the whole limit; a third of cat's is refused by its rule (a quota
            # of 2): if that refusal kept its place, bob's critical request below would find none
            for status in (200, 200, 429):
                assert httpx.get(url, params={"delay": 0}, headers={"x-user": "cat", **CRITICAL}).status_code == status
            # bob's five shed requests spent nothing: his quota of 2 is whole, and the total has counted
            # ann's 1 and cat's 2 only
            answer = httpx.get(url, params={"delay": 0}, headers={"x-user": "bob", **CRITICAL})
            assert answer.status_code == 200, answer.text
            assert '"user";r=1' in answer.headers["ratelimit"] and '"total";r=96' in answer.headers["ratelimit"]
        # the client left: its place is given back, and a sheddable request is admitted again
        wait_until(lambda: httpx.get(url, params={"delay": 0}, headers={"x-user": "dan"}).status_code == 200)
    finally:
        proc.stop()


LADDER = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up:
    url: "{upstream}"
    timeout: 90s
    protect:
      min_limit: 4
      max_limit: 4
      priorities:
        - {{name: critical, match: {{headers: {{x-priority: critical}}}}}}
        - {{name: normal, match: {{headers: {{x-priority: normal}}}}}}
        - {{name: sheddable}}
routes:
  - {{name: held, match: {{path: /inflight}}, upstream: up}}
"""


def test_at_the_limit_the_lowest_priority_is_refused_first_and_critical_last(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    proc = gateway(tmp_path, redis_proc, LADDER, upstream=upstream_own.url)
    url = proc.url + "/inflight"
    held: list[socket.socket] = []

    def hold(priority: str) -> None:
        sock = socket.create_connection(("127.0.0.1", proc.port))
        sock.sendall(b"GET /inflight?delay=60 HTTP/1.1\r\nHost: a\r\nX-Priority: %s\r\n\r\n" % priority.encode())
        held.append(sock)
        wait_until(lambda: httpx.get(upstream_own.url + "/inflight-max").json()["now"] == len(held))

    def status(priority: str) -> int:
        return httpx.get(url, params={"delay": 0}, headers={"x-priority": priority}).status_code

    try:  # a limit of 4: sheddable may fill 2 places (50%), normal 3 (75%), critical all 4
        hold("sheddable")
        hold("sheddable")
        assert [status("sheddable"), status("normal"), status("critical")] == [503, 200, 200]
        hold("normal")
        assert [status("sheddable"), status("normal"), status("critical")] == [503, 503, 200]
        hold("critical")
        assert [status("sheddable"), status("normal"), status("critical")] == [503, 503, 503]
        held.pop().close()  # the critical request's client leaves: its place is free again
        wait_until(lambda: status("critical") == 200)
        assert status("normal") == 503
        # a field a priority matches on, sent twice: which priority is it? A 400, as for a route's match
        twice = httpx.get(url, params={"delay": 0}, headers=[("x-priority", "critical"), ("x-priority", "normal")])
        assert twice.status_code == 400 and "x-priority" in twice.json()["detail"], twice.text
    finally:
        for sock in held:
            sock.close()
        proc.stop()


def test_a_reload_keeps_the_places_in_flight_of_an_unchanged_protect(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    proc = gateway(tmp_path, redis_proc, LADDER, upstream=upstream_own.url)
    url = proc.url + "/inflight"
    held = []
    try:  # two sheddable requests fill their share of the limit of 4
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", proc.port))
            sock.sendall(b"GET /inflight?delay=60 HTTP/1.1\r\nHost: a\r\n\r\n")
            held.append(sock)
            wait_until(lambda: httpx.get(upstream_own.url + "/inflight-max").json()["now"] == len(held))
        assert httpx.post(proc.admin_url + "/reload").status_code == 200
        # the new configuration's limit still counts the two in flight: a third sheddable is refused
        assert httpx.get(url, params={"delay": 0}).status_code == 503
        for sock in held:
            sock.close()
        held.clear()
        wait_until(lambda: httpx.get(url, params={"delay": 0}).status_code == 200)
    finally:
        for sock in held:
            sock.close()
        proc.stop()


@pytest.mark.parametrize(("protect", "message"), [
    ("{priorities: [{name: a}, {name: b, match: {methods: [GET]}}]}", "the last priority takes every request"),
    ("{priorities: [{name: a, share: 50, match: {methods: [GET]}}, {name: b, share: 80}]}",
     "may fill no more of the limit than the one before it"),
    ("{priorities: [{name: a, match: {methods: [GTE]}}, {name: b}]}", "GTE is no HTTP method"),
    ("{priorities: [{name: a, match: {path: /x}}, {name: b}]}", "unknown key"),
    ("{latency: {target: soon}}", "target"),
    ("{min_limit: 10, max_limit: 5}", "must not exceed max_limit"),
    ("{priorities: []}", "at least one priority"),
    ("{priorities: [{name: a, match: {plan: pro}}, {name: b}]}", "matching on a plan needs a top-level keys:"),
    ("{scope: everywhere}", "is not one of worker, fleet"),
    ("{scope: fleet, priorities: [{name: a}, {name: b, queue: {size: 5}}]}", "a queue needs scope: worker"),
    ("{priorities: [{name: a, queue: {timeout: 1s}}]}", "size"),
])
def test_protect_settings_that_cannot_work_are_refused_with_their_line(protect: str, message: str) -> None:
    text = f"""
version: 1
upstreams:
  up: {{url: "http://127.0.0.1:9", protect: {protect}}}
routes:
  - {{name: r, match: {{path: /}}, upstream: up}}
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "routes.yaml", {})
    assert message in str(caught.value) and "routes.yaml:4" in str(caught.value), str(caught.value)


def test_a_priority_names_plans_of_keys() -> None:
    text = """
version: 1
keys: {source: "header:X-Api-Key", plans: [free, pro]}
upstreams:
  up:
    url: "http://127.0.0.1:9"
    protect:
      priorities:
        - {name: paying, match: {plan: [pro, prp]}}
        - {name: rest}
routes:
  - {name: r, match: {path: /}, upstream: up}
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "routes.yaml", {})
    assert "routes.yaml:9: upstreams.up.protect.priorities[0].match.plan: no plan named 'prp' in keys.plans " \
           "(did you mean pro?)" in str(caught.value), str(caught.value)
    config = parse_config(text.replace("prp", "free"), "routes.yaml", {})
    protect = config.upstreams["up"].protect
    assert protect is not None and protect.priorities[0].when.plans == {"pro", "free"}


QUEUED = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
  up:
    url: "{upstream}"
    timeout: 90s
    protect:
      min_limit: 2
      max_limit: 2
      priorities:
        - {{name: critical, match: {{headers: {{x-priority: critical}}}}}}
        - {{name: normal, match: {{headers: {{x-priority: normal}}}}, queue: {{size: 5, timeout: 100ms}}}}
        - {{name: sheddable, queue: {{size: 1, timeout: 60s}}}}
routes:
  - {{name: held, match: {{path: /inflight}}, upstream: up}}
"""


def test_a_priority_with_a_queue_waits_for_a_place_until_its_deadline(
        tmp_path: Path, redis_proc: RedisProcess, upstream_own: Upstream) -> None:
    proc = gateway(tmp_path, redis_proc, QUEUED, upstream=upstream_own.url)
    url = proc.url + "/inflight"
    held: list[socket.socket] = []

    def send(priority: str, delay: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", proc.port))
        sock.sendall(b"GET /inflight?delay=%d HTTP/1.1\r\nHost: a\r\nX-Priority: %s\r\n\r\n" % (delay,
                                                                                               priority.encode()))
        held.append(sock)
        return sock

    def queued(priority: str) -> float:
        text = httpx.get(proc.admin_url + "/metrics").text
        found = re.search(rf'gateway_protect_queued\{{priority="{priority}",route="\*",upstream="up"\}} ([0-9.]+)',
                          text)
        return float(found.group(1)) if found else 0.0

    try:  # a limit of 2: sheddable requests fill 1 place (50%), normal ones 1.5, critical ones both
        send("sheddable", 60)
        wait_until(lambda: httpx.get(upstream_own.url + "/inflight-max").json()["now"] == 1)
        waiting = send("sheddable", 0)  # no place: it waits in its queue (of 1) ...
        wait_until(lambda: queued("sheddable") == 1)
        full = httpx.get(url, params={"delay": 0})  # ... which is full: the next one is refused at once
        assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
        # a critical request still finds the place the waiting sheddable one may not take
        assert httpx.get(url, params={"delay": 0}, headers=CRITICAL).status_code == 200
        send("critical", 60)
        wait_until(lambda: httpx.get(upstream_own.url + "/inflight-max").json()["now"] == 2)
        # the limit full: a normal request waits its 100 ms and is refused
        late = httpx.get(url, params={"delay": 0}, headers={"x-priority": "normal"})
        assert late.status_code == 503 and late.json()["priority"] == "normal", late.text
        assert queued("sheddable") == 1
        for sock in (held[0], held[2]):  # the first sheddable and the critical request's clients leave: the
            sock.close()                 # sheddable share is free again, and goes to the one waiting
        waiting.settimeout(within(20.0))
        assert waiting.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert queued("sheddable") == 0
    finally:
        for sock in held:
            sock.close()
        proc.stop()
