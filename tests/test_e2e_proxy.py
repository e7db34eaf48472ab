"""End to end: a real gateway process (two workers), a real upstream, a real Redis.

Every status code, header and body of SPEC section 4 as a client sees them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

SECRET = "s3cret-for-tests-only-0123456789abcdef"

CONFIG = """
version: 1
redis: {{timeout: 200ms, key_prefix: {prefix}}}
defaults: {{failure_mode: open, headers: draft}}
trusted_proxies: [10.0.0.0/8]
jwt: {{algorithms: [HS256], secret: "{secret}"}}
upstreams:
  up: {{url: "{upstream}", timeout: 2s, connect_timeout: 500ms}}
  dead: {{url: "http://127.0.0.1:{dead_port}", timeout: 1s, connect_timeout: 500ms}}
routes:
  - name: seckill
    match: {{path: "/echo/seckill/{{item_id}}", methods: [POST]}}
    upstream: up
    limits:
      - {{name: user,   by: [header:X-User-Id], algorithm: token_bucket, rate: 1/min, burst: 3}}
      - {{name: stock,  by: [path:item_id], algorithm: quota, limit: 5}}
      - {{name: dedupe, by: [header:X-User-Id, body], algorithm: fixed_window, limit: 1, window: 60s, status: 409}}
  - name: legacy
    match: {{path: /echo/legacy}}
    upstream: up
    headers: legacy
    limits:
      - {{name: ip, by: [ip], algorithm: fixed_window, limit: 2, window: 60s}}
  - name: both
    match: {{path: /echo/both}}
    upstream: up
    headers: both
    limits:
      - {{name: q, by: [query:k], algorithm: sliding_log, limit: 1, window: 60s}}
  - name: none
    match: {{path: /echo/none}}
    upstream: up
    headers: none
    limits:
      - {{name: c, by: [cookie:sid], algorithm: gcra, rate: 1/min, burst: 1}}
  - name: skip
    match: {{path: /echo/skip}}
    upstream: up
    limits:
      - {{name: maybe, by: [header:X-Key], algorithm: quota, limit: 1, on_missing: skip}}
      - {{name: fallback, by: [header:X-Other], algorithm: quota, limit: 1, on_missing: ip}}
  - name: costly
    match: {{path: /echo/costly}}
    upstream: up
    limits:
      - {{name: units, by: [header:X-Tenant], algorithm: token_bucket, rate: 1/h, burst: 10, cost: "header:X-Cost"}}
  - name: jwt
    match: {{path: /echo/jwt}}
    upstream: up
    limits:
      - {{name: sub, by: ["jwt:sub"], algorithm: quota, limit: 1}}
  - name: shadow
    match: {{path: /echo/shadow}}
    upstream: up
    limits:
      - {{name: watch, by: [], algorithm: quota, limit: 1, shadow: true}}
  - name: leaky
    match: {{path: /echo/leaky}}
    upstream: up
    limits:
      - {{name: drip, by: [header:X-Run], algorithm: leaky_bucket, rate: 5/s, burst: 5}}
  - name: xff
    match: {{path: /echo/xff}}
    upstream: up
    limits:
      - {{name: perip, by: [ip], algorithm: quota, limit: 1}}
  - name: ids
    match: {{path: "/echo/ids/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: one, by: [header:X-Id], algorithm: quota, limit: 1}}
      - {{name: two, by: [header:X-A, header:X-B], algorithm: quota, limit: 1, on_missing: skip}}
  - name: deadroute
    match: {{path: /dead}}
    upstream: dead
  - name: slow
    match: {{path: /slow}}
    upstream: up
  - name: big
    match: {{path: "/{{rest:path}}", methods: [GET, POST, PUT, HEAD, DELETE]}}
    upstream: up
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("gw")
    text = CONFIG.format(prefix=f"t{uuid.uuid4().hex[:8]}", secret=SECRET, upstream=upstream.url,
                         dead_port=free_port())
    proc = GatewayProcess(text, workdir, redis_url=redis_proc.url, workers=2)
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=10) as c:
        yield c


def upstream_headers(response: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.json()["headers"]}


def problem(response: httpx.Response) -> dict[str, object]:
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == response.status_code
    assert body["type"] == "about:blank"
    return body  # type: ignore[no-any-return]


def test_admitted_request_is_forwarded_with_forwarding_headers(client: httpx.Client) -> None:
    response = client.get("/echo/plain?a=1&b=%20x", headers={
        "X-Forwarded-For": "203.0.113.9",
        "Connection": "X-Secret-Hop, keep-alive",
        "X-Secret-Hop": "must not pass",
        "TE": "trailers",
        "Host": "shop.example",
    })
    assert response.status_code == 200
    seen = upstream_headers(response)
    assert seen["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == "shop.example"
    assert "x-secret-hop" not in seen
    assert "te" not in seen
    assert response.json()["raw_path"] == "/echo/plain?a=1&b=%20x"  # forwarded byte for byte
    assert len(seen["x-request-id"]) == 32
    assert response.headers["x-request-id"] == seen["x-request-id"]
    assert response.headers["x-upstream"] == "echo"
    assert "keep-alive" not in response.headers  # hop-by-hop from the upstream is dropped too


def test_request_id_is_passed_through(client: httpx.Client) -> None:
    response = client.get("/echo/plain", headers={"X-Request-Id": "abc-123"})
    assert upstream_headers(response)["x-request-id"] == "abc-123"
    assert response.headers["x-request-id"] == "abc-123"


def test_refusal_is_problem_json_with_honest_retry_after(client: httpx.Client) -> None:
    user = {"X-User-Id": f"u-{uuid.uuid4().hex}"}
    statuses = [client.post(f"/echo/seckill/a{i}", headers=user, content=f"b{i}").status_code for i in range(3)]
    assert statuses == [200, 200, 200]
    refused = client.post("/echo/seckill/a9", headers=user, content="b9")
    assert refused.status_code == 429
    body = problem(refused)
    assert body["title"] == "Too Many Requests"
    assert body["route"] == "seckill" and body["rule"] == "user"
    assert body["detail"] == "rate limit 'user' of route 'seckill' exceeded"
    # one token per minute: the honest wait is just under 60 s (the first token was taken first)
    assert 55_000 < int(body["retry_after_ms"]) <= 60_000  # type: ignore[call-overload]
    assert refused.headers["retry-after"] == str(-(-int(body["retry_after_ms"]) // 1000))  # type: ignore[call-overload]
    # the refusing rule first, then every other rule the request was counted by (the fields are lists)
    assert refused.headers["ratelimit-policy"] == '"user";q=3;w=180, "stock";q=5, "dedupe";q=1;w=60'
    assert refused.headers["ratelimit"].startswith('"user";r=0;t=')


def test_admitted_response_names_most_restrictive_rule(client: httpx.Client) -> None:
    item = uuid.uuid4().hex[:8]
    response = client.post(f"/echo/seckill/{item}", headers={"X-User-Id": uuid.uuid4().hex}, content="x")
    assert response.status_code == 200
    # dedupe (1 per window) is used up: it is the most restrictive rule now
    assert response.headers["ratelimit-policy"] == '"dedupe";q=1;w=60, "user";q=3;w=180, "stock";q=5'
    assert response.headers["ratelimit"].startswith('"dedupe";r=0;t=')


def test_quota_refuses_without_retry_after_and_consumes_nothing_when_refused(client: httpx.Client) -> None:
    item = f"stock-{uuid.uuid4().hex[:8]}"
    admitted = 0
    for i in range(8):
        r = client.post(f"/echo/seckill/{item}", headers={"X-User-Id": f"buyer-{i}"}, content=f"{i}")
        admitted += r.status_code == 200
        if r.status_code != 200:
            body = problem(r)
            assert r.status_code == 429 and body["rule"] == "stock"
            assert "retry-after" not in r.headers and "retry_after_ms" not in body
    assert admitted == 5
    # buyer-7 was refused by stock: its own token bucket and dedupe were not charged
    again = client.post(f"/echo/seckill/{uuid.uuid4().hex[:8]}", headers={"X-User-Id": "buyer-7"}, content="7")
    assert again.status_code == 200


def test_duplicate_submit_gets_409(client: httpx.Client) -> None:
    user = {"X-User-Id": f"d-{uuid.uuid4().hex}"}
    assert client.post("/echo/seckill/dup1", headers=user, content='{"qty": 1}').status_code == 200
    second = client.post("/echo/seckill/dup2", headers=user, content='{"qty": 1}')
    assert second.status_code == 409
    assert problem(second)["title"] == "Conflict"
    assert client.post("/echo/seckill/dup3", headers=user, content='{"qty": 2}').status_code == 200


def test_legacy_both_and_none_header_modes(client: httpx.Client) -> None:
    first = client.get("/echo/legacy", headers={"X-Forwarded-For": "198.51.100.1"})
    assert first.headers["x-ratelimit-limit"] == "2"
    assert first.headers["x-ratelimit-remaining"] in ("1", "0")  # ip = 127.0.0.1, shared in module
    assert 0 < int(first.headers["x-ratelimit-reset"]) <= 60
    assert "ratelimit" not in first.headers
    key = uuid.uuid4().hex
    both = client.get(f"/echo/both?k={key}")
    assert both.headers["ratelimit-policy"] == '"q";q=1;w=60'
    assert both.headers["x-ratelimit-remaining"] == "0"
    none = client.get("/echo/none", headers={"Cookie": f"theme=dark; sid={key}"})
    assert none.status_code == 200
    assert not any(h.startswith(("ratelimit", "x-ratelimit")) for h in none.headers)
    refused = client.get("/echo/none", headers={"Cookie": f"sid={key}"})
    assert refused.status_code == 429 and "retry-after" in refused.headers
    assert not any(h.startswith(("ratelimit", "x-ratelimit")) for h in refused.headers)


def test_a_method_no_route_names_is_405_problem(client: httpx.Client) -> None:
    # the last route takes every path, for five methods: PATCH is known nowhere (404 is in test_operators)
    response = client.request("PATCH", "/nowhere")
    assert response.status_code == 405
    assert response.headers["allow"] == "DELETE, GET, HEAD, POST, PUT"
    assert "PATCH is not allowed on /nowhere" in str(problem(response)["detail"])


def test_missing_identity_is_400_and_on_missing_skip_and_ip(client: httpx.Client) -> None:
    missing = client.post("/echo/seckill/1", content="x")
    assert missing.status_code == 400
    body = problem(missing)
    assert body["rule"] == "user"
    # skip: the rule does not apply; ip: falls back to the client address (quota of 1 per ip)
    results = [client.get("/echo/skip").status_code for _ in range(2)]
    assert results[0] in (200, 429) and results[1] == 429
    assert problem(client.get("/echo/skip"))["rule"] == "fallback"
    # an identity equal to the fallback's address is a different key: no collision
    other = client.get("/echo/skip", headers={"X-Other": "127.0.0.1"})
    assert other.status_code == 200


def test_cost_from_header(client: httpx.Client) -> None:
    tenant = {"X-Tenant": uuid.uuid4().hex}
    assert client.get("/echo/costly", headers={**tenant, "X-Cost": "7"}).status_code == 200
    refused = client.get("/echo/costly", headers={**tenant, "X-Cost": "4"})
    assert refused.status_code == 429
    assert client.get("/echo/costly", headers={**tenant, "X-Cost": "3"}).status_code == 200
    never = client.get("/echo/costly", headers={**tenant, "X-Cost": "11"})
    assert never.status_code == 429 and "retry-after" not in never.headers
    assert "can ever admit" in str(problem(never)["detail"])
    assert client.get("/echo/costly", headers={**tenant, "X-Cost": "-1"}).status_code == 400
    assert client.get("/echo/costly", headers={**tenant, "X-Cost": "abc"}).status_code == 400


def _token(claims: dict[str, object], key: str = SECRET, alg: str = "HS256") -> str:
    return jwt.encode(claims, key, algorithm=alg)


def _unsigned(claims: dict[str, object]) -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    return f"{b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{b64(json.dumps(claims).encode())}."


def test_jwt_identity_needs_a_verified_signature(client: httpx.Client) -> None:
    sub = uuid.uuid4().hex
    good = {"Authorization": f"Bearer {_token({'sub': sub})}"}
    assert client.get("/echo/jwt", headers=good).status_code == 200
    assert client.get("/echo/jwt", headers=good).status_code == 429
    for forged in (_unsigned({"sub": sub + "x"}), _token({"sub": sub + "y"}, key="wrong-key-wrong-key-wrong-key-00")):
        response = client.get("/echo/jwt", headers={"Authorization": f"Bearer {forged}"})
        assert response.status_code == 400, forged
        assert "jwt:sub" in str(problem(response)["detail"])
    expired = _token({"sub": sub + "z", "exp": int(time.time()) - 60})
    assert client.get("/echo/jwt", headers={"Authorization": f"Bearer {expired}"}).status_code == 400


def test_shadow_rule_counts_but_never_refuses(client: httpx.Client, gateway: GatewayProcess) -> None:
    statuses = [client.get("/echo/shadow").status_code for _ in range(3)]
    assert statuses == [200, 200, 200]

    def shadow_refusals() -> float:
        text = httpx.get(gateway.admin_url + "/metrics").text
        lines = [x for x in text.splitlines()
                 if x.startswith("gateway_rule_decisions_total") and 'outcome="shadow_refused"' in x
                 and 'rule="watch"' in x]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    # workers hand their counts to Prometheus once a second
    wait_until(lambda: shadow_refusals() >= 2, timeout=5)


def test_leaky_bucket_delays_instead_of_refusing(gateway: GatewayProcess) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as c:
            run_id = uuid.uuid4().hex
            return await asyncio.gather(*[c.get("/echo/leaky", headers={"X-Run": run_id}) for _ in range(8)])

    responses = asyncio.run(run())
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) == 6 and len(refused) == 2  # one leaves now, at most burst=5 wait
    arrivals = sorted(r.json()["received_at"] for r in admitted)
    # departures are spaced at the rate (5/s -> 200 ms): the last left >= 5 intervals after the first
    assert arrivals[-1] - arrivals[0] >= 0.95


def test_x_forwarded_for_is_ignored_from_untrusted_peer(client: httpx.Client) -> None:
    # the test client connects from 127.0.0.1, which is not a trusted proxy here
    first = client.get("/echo/xff", headers={"X-Forwarded-For": "192.0.2.1"})
    second = client.get("/echo/xff", headers={"X-Forwarded-For": "192.0.2.2"})
    assert [first.status_code, second.status_code].count(429) >= 1


def test_hostile_identities_never_collide_or_escape(client: httpx.Client, gateway: GatewayProcess) -> None:
    base = uuid.uuid4().hex[:6]
    hostile = [f"{base}}}:x", f"{base}{{tag}}", f"{base}:", f"{base}\\", f"{base}*?[", f"{base}é",
               f"{base}" + "a" * 1000, f"{base} x", f"{base}\tx"]
    for value in hostile:
        assert client.get("/echo/ids/1", headers={b"X-Id": value.encode()}).status_code == 200, value
    for value in hostile:
        assert client.get("/echo/ids/1", headers={b"X-Id": value.encode()}).status_code == 429, value
    # two parts: ("a:b", "c") and ("a", "b:c") are different identities
    assert client.get("/echo/ids/2", headers={"X-Id": "z1" + base, "X-A": f"{base}a:b", "X-B": "c"}).status_code == 200
    assert client.get("/echo/ids/2", headers={"X-Id": "z2" + base, "X-A": f"{base}a", "X-B": "b:c"}).status_code == 200
    too_long = client.get("/echo/ids/3", headers={"X-Id": "x" * 5000})
    assert too_long.status_code == 400
    state = httpx.get(gateway.admin_url + "/limits/ids/one", params={"key": hostile[0]}).json()
    assert state["remaining"] == 0
    assert len(state["key"]) < 120 and state["key"].count("{") == 1 and state["key"].count("}") == 1


def test_upstream_unreachable_is_502_and_slow_is_504(client: httpx.Client) -> None:
    dead = client.get("/dead")
    assert dead.status_code == 502
    assert "dead" in str(problem(dead)["detail"])
    slow = client.get("/slow", params={"delay": "3"})
    assert slow.status_code == 504
    problem(slow)


def test_upstream_status_and_head_pass_through(client: httpx.Client) -> None:
    assert client.get("/status/418").status_code == 418
    assert client.get("/status/503").status_code == 503
    head = client.head("/bytes", params={"size": "1000"})
    assert head.status_code == 200 and head.content == b""


def _rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_large_bodies_stream_both_ways_in_bounded_memory(gateway: GatewayProcess) -> None:
    size = 150 * 1024 * 1024
    peaks_before = {pid: _rss_peak_kb(pid) for pid in gateway.worker_pids()}
    assert len(peaks_before) == 2

    def chunks() -> Iterator[bytes]:
        block = b"y" * (1 << 20)
        for _ in range(size // len(block)):
            yield block

    with httpx.Client(base_url=gateway.url, timeout=60) as c:
        uploaded = c.post("/upload", content=chunks())
        assert uploaded.status_code == 200
        assert uploaded.json()["length"] == size
        received = 0
        with c.stream("GET", "/bytes", params={"size": str(size)}) as response:
            assert response.status_code == 200
            assert response.headers["content-length"] == str(size)
            for piece in response.iter_bytes():
                received += len(piece)
        assert received == size
    growth_mb = max(_rss_peak_kb(pid) - peaks_before[pid] for pid in peaks_before) / 1024
    assert growth_mb < 64, f"a worker's peak memory grew by {growth_mb:.0f} MiB for a {size >> 20} MiB body"


def test_quota_is_exact_across_two_workers_under_concurrency(gateway: GatewayProcess) -> None:
    item = f"race-{uuid.uuid4().hex[:8]}"

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=20, limits=limits) as c:
            calls = [c.post(f"/echo/seckill/{item}", headers={"X-User-Id": f"r{i}"}, content=str(i))
                     for i in range(60)]
            return [r.status_code for r in await asyncio.gather(*calls)]

    statuses = asyncio.run(run())
    assert statuses.count(200) == 5
    assert statuses.count(429) == 55
