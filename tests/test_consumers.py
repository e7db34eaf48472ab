"""Consumers of API keys (gateway/api_keys.py, gateway/admin/keys.py, gateway/admin/consumers.py): a
key belongs to a consumer, `by: [consumer]` counts every key of one consumer together (a rotated key
keeps the budget), and the usage route, /top, the access log and GET /consumers/{name} name it."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api_keys import KeyTable, digest, fingerprint
from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

APPLIES_WITHIN = 2.0  # seconds: a key written on the admin port reaches the workers within it

STORED = st.sampled_from(["free", "pro", "free acme", "pro acme", "pro globex", None])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), STORED), max_size=60),
       st.lists(st.tuples(st.integers(0, 30), STORED.filter(lambda v: v is not None)), max_size=20))
def test_the_table_answers_each_keys_plan_and_consumer(changes: list[tuple[int, str | None]],
                                                      loaded: list[tuple[int, str]]) -> None:
    table, model = KeyTable(), dict(loaded)
    table.load([(digest(b"k%d" % n), stored) for n, stored in model.items()], 1)
    for n, stored in changes:
        table.apply({digest(b"k%d" % n): stored}, 2)
        if stored is None:
            model.pop(n, None)
        else:
            model[n] = stored
    for n in range(31):
        stored = model.get(n)
        want = None
        if stored is not None:
            plan, _, consumer = stored.partition(" ")
            want = (plan, consumer or fingerprint(digest(b"k%d" % n)))  # no consumer: its own
        assert table.lookup(b"k%d" % n) == want


def test_counting_by_consumer_needs_the_keys_section() -> None:
    route = """\
        version: 1
        upstreams: {up: {url: "http://u:1"}}
        routes:
          - name: r
            match: {path: /r}
            upstream: up
            limits: [{name: month, by: [consumer], algorithm: quota, limit: 5}]
        """
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent(route), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any("routes.yaml:7:" in s and "routes[0](r).limits[0](month).by[0]" in s
               and "consumer identities need a top-level keys: section" in s for s in shown), shown
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent(route).replace("version: 1\n", "version: 1\nkeys: {source: consumer, "
                                                                    "plans: [free]}\n"), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":2: keys.source: consumer is what a key is registered with" in s for s in shown), shown
    keyed = textwrap.dedent(route).replace("version: 1\n", "version: 1\nkeys: {source: header:X-Api-Key, "
                                                           "plans: [free]}\n")
    assert parse_config(keyed, "routes.yaml", {}).routes[0].limits[0].by[0].kind == "consumer"


CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
access_log: true
keys: {{source: "header:X-Api-Key", plans: [free, pro]}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: usage
    match: {{path: /usage}}
    respond: usage
  - name: orders
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits: [{{name: monthly, by: [consumer], algorithm: quota, limit: 5, period: month}}]
"""


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    config = CONFIG.format(prefix=f"c{uuid.uuid4().hex[:8]}", upstream=upstream.url)
    process = GatewayProcess(config, tmp_path, redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _status(gateway: GatewayProcess, key: str, path: str = "/echo/orders") -> int:
    return httpx.get(gateway.url + path, headers={"X-Api-Key": key}).status_code


def _until_known(gateway: GatewayProcess, key: str, status: int = 200) -> None:
    """Until the worker has read the key (the usage route charges nothing)."""
    wait_until(lambda: _status(gateway, key, "/usage") == status, timeout=APPLIES_WITHIN)


def test_a_rotated_key_keeps_its_consumers_budget(gateway: GatewayProcess) -> None:
    old, new, other = ("sk_" + uuid.uuid4().hex for _ in range(3))
    with httpx.Client(base_url=gateway.admin_url) as admin:
        put = admin.put("/keys", params={"key": old},
                        json={"plan": "pro", "consumer": "acme", "metadata": {"email": "ops@acme.example"}})
        assert put.status_code == 200, put.text
        assert put.json() == {"key": fingerprint(digest(old.encode())), "plan": "pro", "consumer": "acme",
                              "metadata": {"email": "ops@acme.example"}}
        assert admin.put("/keys", params={"key": other}, json={"plan": "free"}).status_code == 200
        _until_known(gateway, old)
        _until_known(gateway, other)
        assert [_status(gateway, old) for _ in range(3)] == [200, 200, 200]  # 3 of acme's 5 spent
        assert _status(gateway, other) == 200
        # rotation: the new key for the same consumer, then the old one revoked
        assert admin.put("/keys", params={"key": new}, json={"plan": "pro", "consumer": "acme"}).status_code == 200
        assert admin.delete("/keys", params={"key": old}).status_code == 200
        _until_known(gateway, old, 401)
        _until_known(gateway, new)
        assert [_status(gateway, new) for _ in range(3)] == [200, 200, 429]  # 2 left, not a fresh 5
        assert _status(gateway, other) == 200  # a key of its own: its own budget
        usage = httpx.get(gateway.url + "/usage", headers={"X-Api-Key": new}).json()
        assert usage == {"consumer": "acme", "usage": [{"route": "orders", "rule": "monthly", "limit": 5,
                                                        "remaining": 0, "reset_ms": usage["usage"][0]["reset_ms"]}]}
        own = fingerprint(digest(other.encode()))
        assert httpx.get(gateway.url + "/usage", headers={"X-Api-Key": other}).json()["consumer"] == own

        consumer = admin.get("/consumers/acme")
        assert consumer.status_code == 200, consumer.text
        body = consumer.json()
        assert body["keys"] == [{"key": fingerprint(digest(new.encode())), "plan": "pro", "consumer": "acme",
                                 "metadata": {}}]
        [row] = body["usage"]
        assert (row["route"], row["rule"], row["limit"], row["remaining"]) == ("orders", "monthly", 5, 0)
        assert row["reset_ms"] > 0 and new not in consumer.text
        state = admin.get("/limits/orders/monthly", params={"key": "acme"}).json()  # key= names the consumer
        assert (state["identity"], state["remaining"], state["exhausted"]) == ("acme", 0, True)
        mine = admin.get(f"/consumers/{own}").json()
        assert [k["key"] for k in mine["keys"]] == [own] and mine["usage"][0]["remaining"] == 3
        missing = admin.get("/consumers/initech")
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"
        assert admin.get(f"/consumers/{fingerprint(digest(old.encode()))}").status_code == 404  # revoked
        assert admin.get("/consumers/no:such").status_code == 404

        wait_until(lambda: any(entry["consumer"] == "acme" for entry in
                               admin.get("/top", params={"route": "orders"}).json()["top"]), timeout=5)
    assert gateway.stop() == 0
    lines = [json.loads(line) for line in gateway.out_path.read_text().splitlines() if line.startswith("{")]
    refused = [line for line in lines if line.get("route") == "orders" and line["status"] == 429]
    assert [(line["consumer"], line["identity"]) for line in refused] == [("acme", "acme")]
    admitted = [line for line in lines if line.get("route") == "orders" and line["status"] == 200]
    assert {line["consumer"] for line in admitted} == {"acme", fingerprint(digest(other.encode()))}


def test_a_bad_consumer_or_metadata_is_a_400_and_changes_nothing(gateway: GatewayProcess) -> None:
    def refused(answer: httpx.Response, field: str) -> bool:
        return (answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json"
                and answer.json()["field"] == field)

    with httpx.Client(base_url=gateway.admin_url) as admin:
        def put(body: object) -> httpx.Response:
            return admin.put("/keys", params={"key": "k1"}, json=body)

        assert refused(put({"plan": "pro", "consumer": "acme corp"}), "consumer")
        assert refused(put({"plan": "pro", "consumer": "a:b"}), "consumer")
        assert refused(put({"plan": "pro", "consumer": ""}), "consumer")
        assert refused(put({"plan": "pro", "consumer": 7}), "consumer")
        assert refused(put({"plan": "pro", "consumer": "x" * 65}), "consumer")
        assert refused(put({"plan": "pro", "consumer": "kf_0123456789abcdef"}), "consumer")
        assert refused(put({"plan": "pro", "metadata": ["not", "an", "object"]}), "metadata")
        assert refused(put({"plan": "pro", "metadata": {"note": "x" * 3000}}), "metadata")
        assert refused(put({"plan": "pro", "owner": "acme"}), "plan")
        for raw in (b'{"plan": "pro", "metadata": {"ratio": NaN}}', b'{"plan": "pro", "metadata": {"a": Infinity}}'):
            assert refused(admin.put("/keys", params={"key": "k1"}, content=raw), "metadata"), raw
        deep = b'{"plan": "pro", "metadata": {"a": ' + b"[" * 1500 + b"]" * 1500 + b"}}"  # past what JSON is read with
        answer = admin.put("/keys", params={"key": "k1"}, content=deep)
        assert answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json"
        assert admin.get("/keys", params={"key": "k1"}).status_code == 404
        bulk: dict[str, list[dict[str, Any]]] = {"keys": [{"key": "b1", "plan": "free", "consumer": "acme"},
                         {"key": "b2", "plan": "pro", "consumer": "acme", "metadata": "no"}]}
        assert refused(admin.post("/keys", json=bulk), "keys[1].metadata")
        assert admin.get("/keys", params={"key": "b1"}).status_code == 404  # all or none
        bulk["keys"][1]["metadata"] = {"region": "eu"}
        assert admin.post("/keys", json=bulk).json() == {"written": 2}
        assert admin.get("/keys", params={"key": "b2"}).json()["metadata"] == {"region": "eu"}
        listed = admin.get("/consumers/acme").json()["keys"]
        assert sorted(k["key"] for k in listed) == sorted(fingerprint(digest(k)) for k in (b"b1", b"b2"))
        # a key's own fingerprint, as GET /keys shows it, names its own consumer: a read-modify-write works
        own = admin.put("/keys", params={"key": "k2"}, json={"plan": "free"}).json()
        again = admin.put("/keys", params={"key": "k2"},
                          json={"plan": "pro", "consumer": own["consumer"], "metadata": own["metadata"]})
        assert again.json()["consumer"] == fingerprint(digest(b"k2")) == own["consumer"]
        # a change of plan keeps the consumer and metadata it leaves out; null clears them
        assert admin.put("/keys", params={"key": "b2"}, json={"plan": "free"}).json() == {
            "key": fingerprint(digest(b"b2")), "plan": "free", "consumer": "acme", "metadata": {"region": "eu"}}
        assert admin.get("/keys", params={"key": "b2"}).json()["consumer"] == "acme"
        # moving a key to another consumer takes it off the first one's list
        assert admin.put("/keys", params={"key": "b1"}, json={"plan": "free", "consumer": "globex"}).status_code == 200
        assert [k["key"] for k in admin.get("/consumers/acme").json()["keys"]] == [fingerprint(digest(b"b2"))]
        assert [k["key"] for k in admin.get("/consumers/globex").json()["keys"]] == [fingerprint(digest(b"b1"))]
        cleared = admin.put("/keys", params={"key": "b2"}, json={"plan": "free", "consumer": None, "metadata": None})
        assert cleared.json()["consumer"] == fingerprint(digest(b"b2")) and cleared.json()["metadata"] == {}
        assert admin.get("/keys", params={"key": "b2"}).json()["metadata"] == {}
        assert admin.get("/consumers/acme").status_code == 404  # no key of acme's left
