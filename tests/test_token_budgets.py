"""Token budgets (issue 31, SPEC section 2): reserve at admission, settle from the answer, while it
streams. The gateway is a real process with a real Redis, in front of an OpenAI-compatible upstream
of the tests' own (tests/support/llm_upstream.py) that decides every TCP write.

The bound (docs/algorithms.md, "Token budgets"): a request is admitted only if its reserve fits; an
answer that used more than it reserved is charged the difference after it, so a budget can be
overspent by at most the sum, over the requests in flight, of (used - reserved). An answer cut
short, an error, or no usage in the answer: the reserve stands.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.keys import identity_token, secret_part  # an X-Api-Key value is keyed by its fingerprint
from tests.support.gateway_proc import GatewayProcess
from tests.support.llm_upstream import LlmUpstream
from tests.support.orphans import started
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until

CONFIG = """\
version: 1
upstreams: {{llm: {{url: "{url}", timeout: 20s}}}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions, methods: [POST]}}
    upstream: llm
    limits:
      - name: minute
        by: [header:X-Api-Key]
        algorithm: fixed_window
        limit: 1000
        window: 1h
        cost: {{reserve: "request_json:max_tokens", default: 200, settle: "response_json:usage.total_tokens"}}
        refund_on: [5xx]
      - name: day
        by: [header:X-Api-Key]
        algorithm: token_bucket
        rate: 1/h
        burst: 5000
        cost: {{reserve: "request_json:max_tokens", default: 200, settle: "response_json:usage.total_tokens"}}
  - name: messages
    match: {{path: /v1/messages, methods: [POST]}}
    upstream: llm
    limits:
      - {{name: output, by: [header:X-Api-Key], algorithm: quota, limit: 1000,
         cost: {{reserve: "request_json:max_tokens", default: 100, settle: "response_json:usage.output_tokens"}}}}
"""


@pytest.fixture(scope="module")
def llm() -> Iterator[LlmUpstream]:
    upstream = LlmUpstream()
    upstream.start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            llm: LlmUpstream) -> Iterator[GatewayProcess]:
    process = GatewayProcess(CONFIG.format(url=llm.url), tmp_path_factory.mktemp("tokens"), redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        assert "Traceback" not in process.log(), process.log()


def key() -> str:
    return f"k{random.getrandbits(40):x}"


def ask(gateway: GatewayProcess, api_key: str, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers={"X-Api-Key": api_key}, timeout=20)


def ask_with(gateway: GatewayProcess, api_key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"X-Api-Key": api_key}, timeout=20)


def remaining(gateway: GatewayProcess, api_key: str, rule: str = "minute", route: str = "chat") -> int:
    state = httpx.get(f"{gateway.admin_url}/limits/{route}/{rule}", params={"key": api_key}, timeout=5)
    assert state.status_code == 200, state.text
    return int(state.json()["remaining"])


def settles_to(gateway: GatewayProcess, api_key: str, expected: int, rule: str = "minute",
               route: str = "chat") -> None:
    """The settlement is sent in the background: wait for the budget to say `expected`."""
    seen: list[int] = []

    def there() -> bool:
        seen.append(remaining(gateway, api_key, rule, route))
        return seen[-1] == expected

    try:
        wait_until(there, timeout=10)
    except TimeoutError:
        raise AssertionError(f"{route}/{rule} stayed at {seen[-1]}, not {expected}") from None


def test_a_json_answer_settles_down_to_what_it_used(gateway: GatewayProcess) -> None:
    k = key()
    response = ask(gateway, k, max_tokens=300, used=40)
    assert response.status_code == 200 and response.json()["usage"]["total_tokens"] == 40
    settles_to(gateway, k, 1000 - 40)
    settles_to(gateway, k, 5000 - 40, rule="day")  # several budgets on one request settle together


def test_a_stream_settles_up_to_what_it_used(gateway: GatewayProcess) -> None:
    """OpenAI's streaming with stream_options.include_usage: the last chunk carries the usage."""
    k = key()
    response = ask(gateway, k, max_tokens=100, used=250, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")  # the stream reached the client unchanged
    settles_to(gateway, k, 1000 - 250)


def test_anthropic_style_events(gateway: GatewayProcess) -> None:
    k = key()
    response = ask(gateway, k, path="/v1/messages", max_tokens=300, used=120, stream=True, style="anthropic")
    assert response.status_code == 200 and "message_delta" in response.text
    settles_to(gateway, k, 1000 - 120, rule="output", route="messages")


@pytest.mark.parametrize("shape", [{"split": True}, {"pad": 100_000}])
def test_events_split_across_writes_and_larger_than_a_read(gateway: GatewayProcess, shape: dict[str, Any]) -> None:
    k = key()
    response = ask(gateway, k, max_tokens=100, used=70, stream=True, **shape)
    assert response.status_code == 200
    settles_to(gateway, k, 1000 - 70)


def test_a_stream_cut_mid_event_keeps_the_reserve(gateway: GatewayProcess) -> None:
    k = key()
    with pytest.raises(httpx.HTTPError):  # the client sees the answer break off
        ask(gateway, k, max_tokens=150, used=20, stream=True, cut=True)
    settles_to(gateway, k, 1000 - 150)
    time.sleep(0.3)  # nothing more arrives later: the reserve stands
    assert remaining(gateway, k) == 1000 - 150
    # the operator is told, as nginx's "upstream prematurely closed connection" does
    broke_off = [line for line in gateway.log().splitlines() if "broke off its 200 answer" in line]
    assert len(broke_off) == 1 and "upstream 'llm'" in broke_off[0] and "request id " in broke_off[0], broke_off


def test_no_usage_keeps_the_reserve_and_an_error_is_refunded(gateway: GatewayProcess) -> None:
    k = key()
    assert ask(gateway, k, max_tokens=130).status_code == 200  # an answer without usage
    settles_to(gateway, k, 1000 - 130)
    assert ask(gateway, k, max_tokens=130, status=500).status_code == 500  # refund_on: [5xx]
    settles_to(gateway, k, 1000 - 130)
    settles_to(gateway, k, 5000 - 260, rule="day")  # no refund_on there: both reserves stand


def test_a_body_without_the_field_or_not_json_reserves_the_default(gateway: GatewayProcess) -> None:
    k = key()
    response = httpx.post(gateway.url + "/v1/chat/completions", content=b"not json", timeout=10,
                          headers={"X-Api-Key": k, "content-type": "application/json"})
    assert response.status_code == 200
    settles_to(gateway, k, 1000 - 200)
    big = {"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 10}
    assert ask_with(gateway, k, big).status_code == 200  # past identity.body_max_bytes: the default
    settles_to(gateway, k, 1000 - 400)


def test_a_reserve_that_does_not_fit_is_refused(gateway: GatewayProcess) -> None:
    k = key()
    assert ask(gateway, k, max_tokens=900, used=900).status_code == 200
    settles_to(gateway, k, 100)
    refused = ask(gateway, k, max_tokens=200)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    assert ask(gateway, k, max_tokens=100, used=100).status_code == 200


def test_the_first_event_reaches_the_client_before_the_upstream_writes_the_last(gateway: GatewayProcess,
                                                                                  llm: LlmUpstream) -> None:
    k = key()
    released = llm.hold(k)
    first_at: list[float] = []

    def run() -> None:
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers={"X-Api-Key": k}, timeout=20,
                          json={"max_tokens": 100, "used": 60, "stream": True, "hold": k}) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and not first_at:
                    first_at.append(time.monotonic())
                    released.set()  # only now may the upstream go on

    run()
    assert first_at and released.is_set()
    wait_until(lambda: k in llm.finished)
    assert first_at[0] < llm.finished[k]  # the client had the first event before the last was written
    settles_to(gateway, k, 1000 - 60)


@pytest.mark.parametrize("over", [0, 20])
def test_50_concurrent_streams_never_overspend_past_the_bound(gateway: GatewayProcess, redis_proc: RedisProcess,
                                                              over: int) -> None:
    """50 streams at once on one key, each reserving 100 of 1000 and using 100 + `over`: at most 10
    are admitted, and the budget ends at most 10 x `over` past its limit (none when no answer uses
    more than it reserved)."""
    k = key()

    async def one(client: httpx.AsyncClient) -> int:
        response = await client.post("/v1/chat/completions", headers={"X-Api-Key": k},
                                      json={"max_tokens": 100, "used": 100 + over, "stream": True, "events": 20})
        return response.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                     limits=httpx.Limits(max_connections=60)) as client:
            return list(await asyncio.gather(*(one(client) for _ in range(50))))

    statuses = asyncio.run(run())
    admitted = statuses.count(200)
    assert 1 <= admitted <= 10 and statuses.count(429) == 50 - admitted
    count_key = next(iter(redis_proc.client().scan_iter(
        match=f"*{{chat}}:minute:{identity_token([secret_part(k.encode())], readable=False)}")))
    wait_until(lambda: int(redis_proc.client().get(count_key) or 0) == admitted * (100 + over), timeout=10)
    assert int(redis_proc.client().get(count_key) or 0) <= 1000 + admitted * over


def test_the_check_port_refuses_a_token_budget(tmp_path: Any, llm: LlmUpstream) -> None:
    from gateway.config import load_config
    from gateway.errors import ConfigError

    (tmp_path / "routes.yaml").write_text(CONFIG.format(url=llm.url))
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml", decision_only=True)
    assert any(p.key.endswith("(minute).cost") for p in raised.value.problems)


def test_the_repository_example_spends_a_token_budget(tmp_path: Any, redis_proc: RedisProcess) -> None:
    """`make run`: routes.yaml's chat route in front of the example backend, JSON and streaming."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.ports import free_port

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    backend = started([sys.executable, "-m", "gateway.example_backend", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    gateway = GatewayProcess((root / "routes.yaml").read_text(), tmp_path, redis_url=redis_proc.url,
                             env={"SHOP_URL": f"http://127.0.0.1:{port}"})
    try:
        from tests.support.waiting import wait_for_port
        wait_for_port(port, backend)
        gateway.start()
        k = key()
        assert ask(gateway, k, max_tokens=200).json()["usage"]["total_tokens"] == 19
        streamed = ask(gateway, k, max_tokens=3, stream=True)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        settles_to(gateway, k, 2000 - 19 - 15, rule="tokens-hour")
    finally:
        gateway.stop()
        backend.terminate()
        backend.wait(10)
