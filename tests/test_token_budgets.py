"""Token budgets (issue 31, SPEC section 2): reserve at admission, settle from the answer, while it
streams. The gateway is a real process with a real Redis, in front of an OpenAI-compatible upstream
of the tests' own (tests/support/llm_upstream.py) that decides every TCP write.

The bound (docs/algorithms.md, "Token budgets"): a request is admitted only if its reserve fits; an
answer that used more than it reserved is charged the difference after it, so a budget can be
overspent by at most the sum, over the requests in flight, of (used - reserved). An answer cut
short, an error, or no usage in the answer: the reserve stands.

The reserve is read as the upstream reads it (the test upstream reads its requests with pydantic, as
OpenAI-compatible servers do): every spelling of the number, every field that bounds the answer,
times `n`; a `total_tokens` budget also reserves the prompt, and a stream is asked for its usage.
"""

from __future__ import annotations

import asyncio
import json
import os
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

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """\
version: 1
upstreams: {{llm: {{url: "{url}", timeout: 20s}}}}
routes:
  - name: completion
    match: {{path: /v2/chat/completions, methods: [POST]}}
    upstream: llm
    limits:
      - {{name: hour, by: [header:X-Api-Key], algorithm: fixed_window, limit: 10000, window: 1h,
         cost: {{reserve: "request_json:max_tokens", default: 100, settle: "response_json:usage.completion_tokens"}}}}
  - name: capped
    match: {{path: /v3/chat/completions, methods: [POST]}}
    upstream: llm
    limits:
      - {{name: hour, by: [header:X-Api-Key], algorithm: fixed_window, limit: 10000, window: 1h,
         cost: {{reserve: "request_json:max_tokens", default: 100, max: 4000,
                settle: "response_json:usage.completion_tokens"}}}}
  - name: prompted
    match: {{path: /v4/chat/completions, methods: [POST]}}
    upstream: llm
    limits:
      - {{name: hour, by: [header:X-Api-Key], algorithm: fixed_window, limit: 100000, window: 1h,
         cost: {{reserve: "request_json:max_tokens", default: 100, settle: "response_json:usage.total_tokens"}}}}
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


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def ask(gateway: GatewayProcess, api_key: str, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    return ask_raw(gateway, api_key, encoded(body), path)


def ask_with(gateway: GatewayProcess, api_key: str, body: dict[str, Any]) -> httpx.Response:
    return ask_raw(gateway, api_key, encoded(body))


def ask_raw(gateway: GatewayProcess, api_key: str, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(gateway.url + path, content=body, timeout=20,
                      headers={"X-Api-Key": api_key, "content-type": "application/json"})


def prompt(**body: Any) -> int:
    """What a `total_tokens` budget reserves for the prompt of this body: its size in bytes."""
    return len(encoded(body))


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
        ask(gateway, k, max_tokens=150, used=20, stream=True, cut=True, stream_options={"include_usage": True})
    reserved = 150 + prompt(max_tokens=150, used=20, stream=True, cut=True, stream_options={"include_usage": True})
    settles_to(gateway, k, 1000 - reserved)
    # the operator is told, as nginx's "upstream prematurely closed connection" does, once the
    # gateway is done with the answer: nothing more arrives later, the reserve stands
    wait_until(lambda: "broke off its 200 answer" in gateway.log(), timeout=5)
    assert remaining(gateway, k) == 1000 - reserved
    broke_off = [line for line in gateway.log().splitlines() if "broke off its 200 answer" in line]
    assert len(broke_off) == 1 and "upstream 'llm'" in broke_off[0] and "request id " in broke_off[0], broke_off


def test_no_usage_keeps_the_reserve_and_an_error_is_refunded(gateway: GatewayProcess) -> None:
    k = key()
    assert ask(gateway, k, max_tokens=130).status_code == 200  # an answer without usage
    first = 130 + prompt(max_tokens=130)  # a total_tokens budget: the prompt's bytes too
    settles_to(gateway, k, 1000 - first)
    assert ask(gateway, k, max_tokens=130, status=500).status_code == 500  # refund_on: [5xx]
    settles_to(gateway, k, 1000 - first)
    second = 130 + prompt(max_tokens=130, status=500)
    settles_to(gateway, k, 5000 - first - second, rule="day")  # no refund_on there: both reserves stand


@pytest.mark.parametrize("body", [{}, {"max_tokens": None}, {"max_tokens": 0}, {"n": 3}])
def test_a_body_without_the_field_reserves_the_default(gateway: GatewayProcess, body: dict[str, Any]) -> None:
    """Absent, null, or 0 (which some servers read as no bound): `default`, times n."""
    k = key()
    assert ask_raw(gateway, k, encoded(body), "/v2/chat/completions").status_code == 200  # no usage: it stands
    settles_to(gateway, k, 10000 - 100 * body.get("n", 1), rule="hour", route="completion")


def test_a_body_that_is_not_json_or_over_the_read_bound_is_refused(gateway: GatewayProcess, llm: LlmUpstream) -> None:
    """Never reserved at `default`: the upstream might read a reserve the gateway could not."""
    k = key()
    before = llm.requests
    refused = ask_raw(gateway, k, b"not json")
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/problem+json"
    assert "max_tokens" in refused.json()["detail"], refused.text
    big = {"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 9000}
    too_large = ask_with(gateway, k, big)  # past identity.body_max_bytes (64 KiB)
    assert too_large.status_code == 413 and "identity.body_max_bytes" in too_large.json()["detail"], too_large.text
    assert llm.requests == before
    assert remaining(gateway, k) == 1000
    with httpx.Client(base_url=gateway.url, timeout=20, headers={"X-Api-Key": k}) as client:  # one connection
        assert client.post("/v1/chat/completions", json=big).status_code == 413
        assert client.post("/v1/chat/completions", json={"max_tokens": 5, "used": 5}).status_code == 200  # no desync


SPELLINGS = [
    b'"9000"', b"9000.0", b"9e3", b'" 9000 "', b'"9_000"', b'"9000.00"', b'"+9000"',
]
BOUNDS = [
    b'"max_completion_tokens": 9000', b'"max_output_tokens": 9000', b'"max_tokens": 10, "max_completion_tokens": 9000',
    b'"max_tokens": 900, "n": 10', b'"max_tokens": 900, "n": "10"', b'"max_tokens": 900, "best_of": 10',
    b'"max_tokens": 900, "prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]',
    b'"max_tokens": 2250, "n": 2, "prompt": [[1, 2], [3]]',
]


@pytest.mark.parametrize("asked", [b'"max_tokens": ' + spelling for spelling in SPELLINGS] + BOUNDS)
def test_ten_parallel_requests_never_generate_past_the_budget(gateway: GatewayProcess, llm: LlmUpstream,
                                                              asked: bytes) -> None:
    """A budget of 10,000 completion tokens an hour; ten requests at once, each one the upstream
    reads as 9,000 tokens: one is admitted, and the upstream generates at most the budget."""
    k = key()
    tag = key()
    body = b'{%s, "fill": true, "tag": "%s"}' % (asked, tag.encode())

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
            answers = await asyncio.gather(*(
                client.post("/v2/chat/completions", content=body,
                            headers={"X-Api-Key": k, "content-type": "application/json"}) for _ in range(10)))
            return [answer.status_code for answer in answers]

    statuses = asyncio.run(run())
    assert statuses.count(200) == 1 and statuses.count(429) == 9, statuses
    assert llm.generated[tag] == 9000
    settles_to(gateway, k, 1000, rule="hour", route="completion")


@pytest.mark.parametrize(("asked", "field"), [
    (b'"max_tokens": "abc"', "max_tokens"), (b'"max_tokens": -1', "max_tokens"), (b'"max_tokens": 2.5', "max_tokens"),
    (b'"max_tokens": "2.5"', "max_tokens"), (b'"max_tokens": NaN', "max_tokens"),
    (b'"max_tokens": [9000]', "max_tokens"),
    (b'"max_tokens": {"value": 9000}', "max_tokens"), (b'"max_tokens": "0x2328"', "max_tokens"),
    (b'"max_tokens": "9e3"', "max_tokens"), (b'"max_tokens": 1e400', "max_tokens"),
    (b'"max_completion_tokens": "lots"', "max_completion_tokens"), (b'"max_tokens": 10, "n": -1', "n"),
    (b'"max_tokens": 10, "n": "two"', "n"),
])
def test_an_unreadable_reserve_is_refused_before_the_upstream(gateway: GatewayProcess, llm: LlmUpstream,
                                                               asked: bytes, field: str) -> None:
    k = key()
    before = llm.requests
    refused = ask_raw(gateway, k, b"{%s}" % asked, "/v2/chat/completions")
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert f"'{field}'" in refused.json()["detail"], refused.text
    assert llm.requests == before


def test_a_reserve_over_the_rules_max_is_refused(gateway: GatewayProcess, llm: LlmUpstream) -> None:
    """`max:` (default: the rule's limit) bounds the reserve: past it, a 400 that names the field,
    never a reserve cut down to fit."""
    k = key()
    before = llm.requests
    for path, body in (("/v3/chat/completions", {"max_tokens": 4001}),
                       ("/v3/chat/completions", {"max_tokens": 2000, "n": 3}),
                       ("/v2/chat/completions", {"max_completion_tokens": 10001})):
        refused = ask_raw(gateway, k, encoded(body), path)
        assert refused.status_code == 400, refused.text
        assert "max_" in refused.json()["detail"] and "at most" in refused.json()["detail"], refused.text
    assert llm.requests == before
    assert ask_raw(gateway, k, encoded({"max_tokens": 4000, "used": 5}), "/v3/chat/completions").status_code == 200


@pytest.mark.parametrize("shape", ["usage", "field"])
def test_a_repeated_usage_field_settles_the_largest(gateway: GatewayProcess, shape: str) -> None:
    """`{"usage": {...}, "usage": {...smaller}}`: a JSON reader keeps the last; the budget the largest."""
    k = key()
    body = encoded({"max_tokens": 2000, "used": 901, "duplicate": shape})
    response = ask_raw(gateway, k, body, "/v2/chat/completions")
    assert response.status_code == 200 and response.text.count("completion_tokens") == 2, response.text
    settles_to(gateway, k, 10000 - 900, rule="hour", route="completion")


def test_a_total_tokens_budget_reserves_the_prompt(gateway: GatewayProcess, llm: LlmUpstream) -> None:
    """The prompt counts in total_tokens: while the answer streams, its bytes are reserved with
    max_tokens (a prompt is never more tokens than bytes)."""
    k = key()
    body = {"messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}, "used": 7515, "prompt_used": 7505, "hold": k}
    released = llm.hold(k)
    seen: list[int] = []

    def run() -> None:
        with httpx.stream("POST", gateway.url + "/v4/chat/completions", content=encoded(body), timeout=20,
                          headers={"X-Api-Key": k, "content-type": "application/json"}) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and not seen:
                    seen.append(remaining(gateway, k, "hour", "prompted"))  # the answer is held here
                    released.set()

    run()
    assert seen == [100000 - 10 - prompt(**body)]
    settles_to(gateway, k, 100000 - 7515, rule="hour", route="prompted")


def chunked(data: bytes) -> Iterator[bytes]:
    yield data[:100]
    yield data[100:]


@pytest.mark.parametrize(("stream", "options", "framing"), [
    (True, None, "length"), (True, {"include_usage": False}, "length"), (True, {"include_usage": "false"}, "length"),
    ("true", {}, "length"), ("yes", None, "length"), (True, None, "chunked"),
])
def test_a_stream_is_asked_for_its_usage(gateway: GatewayProcess, llm: LlmUpstream, stream: object,
                                         options: object, framing: str) -> None:
    """Without stream_options.include_usage an OpenAI stream carries no usage, and a 15,030-token
    prompt was charged its 10 tokens of max_tokens: the gateway asks for it, and the budget settles
    by it. The client's stream keeps the usage chunk (an OpenAI client reads past it)."""
    k = key()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "word " * 6100}], "max_tokens": 10,
                            "stream": stream, "used": 15040, "prompt_used": 15030, "tag": k}
    if options is not None:
        body["stream_options"] = options
    data = encoded(body)
    response = httpx.post(gateway.url + "/v4/chat/completions", timeout=20,
                          content=data if framing == "length" else chunked(data),
                          headers={"X-Api-Key": k, "content-type": "application/json"})
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
    length, forwarded = llm.received[-1]  # the upstream read its Content-Length's bytes, and they are JSON
    assert forwarded["tag"] == k and forwarded["stream_options"]["include_usage"] is True and length != len(data)
    assert {k: v for k, v in forwarded.items() if k != "stream_options"} == {
        k: v for k, v in body.items() if k != "stream_options"}
    assert '"total_tokens": 15040' in response.text
    settles_to(gateway, k, 100000 - 15040, rule="hour", route="prompted")


def test_a_request_that_does_not_stream_is_forwarded_as_it_came(gateway: GatewayProcess, llm: LlmUpstream) -> None:
    """OpenAI refuses stream_options on a request that does not stream: none is added."""
    k = key()
    for stream in (False, "false", None):
        data = encoded({"max_tokens": 10, "stream": stream, "used": 30})
        assert ask_raw(gateway, k, data, "/v4/chat/completions").status_code == 200
        assert llm.received[-1] == (len(data), json.loads(data))


def test_a_reserve_that_does_not_fit_is_refused(gateway: GatewayProcess) -> None:
    k = key()
    assert ask(gateway, k, max_tokens=900, used=900).status_code == 200
    settles_to(gateway, k, 100)
    refused = ask(gateway, k, max_tokens=200)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    assert ask(gateway, k, max_tokens=50, used=50).status_code == 200  # 50 and its prompt's 30 bytes fit


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
    """50 streams at once on one key, each reserving 100 of 1000 (and its prompt's bytes) and using
    100 + `over`: at most 10 are admitted, and the budget ends at most 10 x `over` past its limit
    (none when no answer uses
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


def test_the_app_behind_the_middleware_reads_the_body_asking_for_usage(tmp_path: Any, redis_proc: RedisProcess) -> None:
    """In-process (gateway.RateLimitMiddleware): the app gets the body the budget counted, with its
    own Content-Length, and its stream settles the budget by its usage."""
    import subprocess
    import sys

    from tests.support.ports import free_port
    from tests.support.waiting import wait_for_port

    route = f"chat-{key()}"
    config = tmp_path / "routes.yaml"
    config.write_text(f"""\
version: 1
routes:
  - name: {route}
    match: {{path: /v1/chat/completions, methods: [POST]}}
    limits:
      - {{name: hour, by: [header:X-Api-Key], algorithm: fixed_window, limit: 100000, window: 1h,
         cost: {{reserve: "request_json:max_tokens", default: 100, settle: "response_json:usage.total_tokens"}}}}
""")
    port = free_port()
    log = tmp_path / "app.log"
    with log.open("wb") as out:
        app = started([sys.executable, "-m", "uvicorn", "tests.support.llm_upstream:embedded_app", "--port", str(port),
                       "--lifespan", "on"], stdout=out, stderr=subprocess.STDOUT,
                      env={**os.environ, "LLM_EMBED_CONFIG": str(config), "LLM_EMBED_REDIS_URL": redis_proc.url})
    try:
        wait_for_port(port, app)
        k = key()
        data = encoded({"messages": [{"role": "user", "content": "word " * 6100}], "max_tokens": 10,
                        "stream": True, "used": 15040, "prompt_used": 15030})
        for body in (data, chunked(data)):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body, timeout=20,
                                  headers={"X-Api-Key": k, "content-type": "application/json"})
            assert response.status_code == 200 and '"total_tokens": 15040' in response.text, response.text[-300:]
            received = json.loads(response.text.split("\n", 1)[0].removeprefix("data: "))["received"]
            assert received["body"]["stream_options"] == {"include_usage": True}
            assert received["content_length"] == [str(received["length"])]
        count_key = next(iter(redis_proc.client().scan_iter(match=f"*{route}*:hour:*")))
        wait_until(lambda: int(redis_proc.client().get(count_key) or 0) == 2 * 15040, timeout=10)
    finally:
        app.terminate()
        app.wait(10)
        assert "Traceback" not in log.read_text(errors="replace")


@pytest.mark.parametrize(("cost", "says"), [
    ('{reserve: "request_json:max_tokens", default: 100, max: 50, settle: "response_json:usage.total_tokens"}',
     "less than the default reserve 100"),
    ('{reserve: "request_json:max_tokens", max: 0, settle: "response_json:usage.total_tokens"}', "whole number from 1"),
    ('{reserve: "request_json:max_tokens", max: "lots", settle: "response_json:usage.total_tokens"}',
     "whole number from 1"),
    ('{reserve: 500, max: 900, settle: "response_json:usage.total_tokens"}', "request_json:FIELD"),
])
def test_a_max_that_can_bound_nothing_is_a_config_error(tmp_path: Any, cost: str, says: str) -> None:
    from gateway.config import load_config
    from gateway.errors import ConfigError

    (tmp_path / "routes.yaml").write_text(f"""\
version: 1
upstreams: {{llm: {{url: "http://127.0.0.1:9"}}}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    upstream: llm
    limits:
      - {{name: hour, by: [ip], algorithm: fixed_window, limit: 1000, window: 1h, cost: {cost}}}
""")
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "routes.yaml")
    assert [p.key for p in raised.value.problems] == ["routes[0](chat).limits[0](hour).cost.max"], raised.value
    assert says in str(raised.value)
