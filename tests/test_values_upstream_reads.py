"""Issue 33's ways past a limit, closed by class: the limit counts the value the upstream reads.

- a number in the path: `{item_id:int}` keys 042 as 42, and refuses (400) the spellings only some
  readers take as a number (+42, 42.0, 4_2, ' 42', fullwidth digits), which before went on to the
  next route;
- a path in another case: `match.path_case: insensitive` for an upstream that routes so;
- a quoted cookie with backslash escapes: decoded as Python's http.cookies (Starlette, aiohttp,
  Django) decodes it, so one value is one key;
- query values outside Latin-1: each UTF-8 value its own key (five users had shared one), and
  invalid sequences one key, as the frameworks read them all as U+FFFD.
Each case failed before its fix. The gateway is a real process; the upstream a real one."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

CONFIG = """\
version: 1
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: seckill
    match: {{path: "/seckill/{{item_id:int}}", methods: [POST]}}
    upstream: up
    limits: [{{name: stock, by: [path:item_id], algorithm: quota, limit: 3}}]
  - name: loose
    match: {{path: "/loose/{{item_id}}", path_case: insensitive}}
    upstream: up
    limits: [{{name: item, by: [path:item_id], algorithm: quota, limit: 2}}]
  - name: session
    match: {{path: /session}}
    upstream: up
    limits: [{{name: sid, by: [cookie:sid], algorithm: quota, limit: 2}}]
  - name: search
    match: {{path: /search}}
    upstream: up
    limits: [{{name: who, by: [query:id], algorithm: quota, limit: 1}}]
  - name: typed-query
    match: {{path: /orders}}
    upstream: up
    limits: [{{name: stock, by: ["query:item:int"], algorithm: quota, limit: 3}}]
  - name: typed-header
    match: {{path: /claim}}
    upstream: up
    limits: [{{name: once, by: ["header:X-Item:int"], algorithm: quota, limit: 1}}]
  - name: typed-cookie
    match: {{path: /cart}}
    upstream: up
    limits: [{{name: once, by: ["cookie:n:int"], algorithm: quota, limit: 1}}]
  - name: typed-float
    match: {{path: "/price/{{amount:float}}"}}
    upstream: up
    limits: [{{name: once, by: [path:amount], algorithm: quota, limit: 1}}]
  - name: typed-by-source
    match: {{path: "/lot/{{lot}}"}}
    upstream: up
    limits: [{{name: once, by: ["path:lot:int"], algorithm: quota, limit: 1}}]
  - name: everything
    match: {{path: "/{{rest:path}}"}}
    upstream: up
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    process = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path_factory.mktemp("reads"),
                             redis_url=redis_proc.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def item() -> int:
    return random.randrange(10**6, 10**7)


def test_a_number_in_the_path_is_counted_as_the_number(gateway: GatewayProcess) -> None:
    n = item()
    spellings = [f"{n}", f"0{n}", f"00{n}", f"{n}", f"000{n}"]
    statuses = [httpx.post(f"{gateway.url}/seckill/{s}").status_code for s in spellings]
    assert statuses == [200, 200, 200, 429, 429]


@pytest.mark.parametrize("spelling", ["+{n}", "{n}.0", "{n}_1", "%20{n}", "{n}%20", "-{n}", "\uff11\uff12\uff13",
                                      "{n}e0", "0x{n}"])
def test_spellings_some_readers_take_as_a_number_are_refused(gateway: GatewayProcess, spelling: str) -> None:
    n = item()
    response = httpx.post(f"{gateway.url}/seckill/{spelling.format(n=n)}")
    assert response.status_code == 400, response.text
    assert "plain decimal digits" in response.json()["detail"]
    assert "x-upstream" not in response.headers  # never forwarded, never the catch-all's


def test_a_segment_without_a_digit_is_another_routes(gateway: GatewayProcess) -> None:
    assert httpx.post(f"{gateway.url}/seckill/latest").status_code == 200  # the catch-all's, as before


def test_path_case_insensitive_routes_count_every_case(gateway: GatewayProcess) -> None:
    n = item()
    statuses = [httpx.get(f"{gateway.url}{path}/{n}").status_code for path in ("/loose", "/LOOSE", "/Loose")]
    assert statuses == [200, 200, 429]


def test_a_quoted_cookie_is_one_key_however_it_is_escaped(gateway: GatewayProcess) -> None:
    sid = f"c{item()}"
    escaped = '"' + "".join(f"\\{ch}" for ch in sid) + '"'       # "\c\1\2..." as Starlette decodes it
    octal = '"' + "\\" + format(ord(sid[0]), "03o") + sid[1:] + '"'  # "\143..." : c in octal
    statuses = [httpx.get(f"{gateway.url}/session", headers={"Cookie": f"sid={value}"}).status_code
                for value in (sid, escaped, octal)]
    assert statuses == [200, 200, 429]


def test_query_values_outside_latin_1_are_each_their_own_key(gateway: GatewayProcess) -> None:
    tag = item()
    users = ["%E4%B8%AD", "%E6%96%87", "%D0%96", "%F0%9F%98%80", "%C3%A9"]
    statuses = [httpx.get(f"{gateway.url}/search?id={u}{tag}").status_code for u in users]
    assert statuses == [200] * 5  # five users, five keys (before: one key, four 429s)
    again = httpx.get(f"{gateway.url}/search?id=%E4%B8%AD{tag}")
    assert again.status_code == 429


def test_invalid_utf8_in_a_query_value_is_one_value(gateway: GatewayProcess) -> None:
    """Starlette and FastAPI read %FF and %FE alike (U+FFFD): two spellings, one key."""
    tag = item()
    first = httpx.get(f"{gateway.url}/search?id=%FF{tag}")
    second = httpx.get(f"{gateway.url}/search?id=%FE{tag}")
    assert (first.status_code, second.status_code) == (200, 429)


def test_fastapi_reads_the_refused_spellings_as_numbers() -> None:
    """Why the spellings are refused: a FastAPI `item_id: int` reads some of them as 42."""
    import asyncio

    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/seckill/{item_id}")
    def order(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    async def read() -> dict[str, object]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return {s: (await client.post(f"/seckill/{s}")).json().get("item_id")
                    for s in ("042", "+42", "%2042", "42%20")}

    assert asyncio.run(read()) == {"042": 42, "+42": 42, "%2042": 42, "42%20": 42}



def test_a_number_in_the_query_is_counted_as_the_number(gateway: GatewayProcess) -> None:
    """?item=042 is 42 to FastAPI's `item: int`: a stock of 3 sold 7 times before."""
    n = item()
    spellings = [f"{n}", f"0{n}", f"00{n}", f"000{n}", f"%30{n}", f"{n}%20", f"+{n}"]  # '+' is a space in a query
    statuses = [httpx.post(f"{gateway.url}/orders?item={s}").status_code for s in spellings]
    assert statuses == [200, 200, 200, 429, 429, 429, 429]


def test_a_number_in_a_header_or_cookie_is_counted_as_the_number(gateway: GatewayProcess) -> None:
    n = item()
    assert httpx.post(f"{gateway.url}/claim", headers={"X-Item": f"{n}"}).status_code == 200
    assert httpx.post(f"{gateway.url}/claim", headers={"X-Item": f"0{n}"}).status_code == 429
    assert httpx.post(f"{gateway.url}/claim", headers={"X-Item": f"00{n}"}).status_code == 429
    assert httpx.get(f"{gateway.url}/cart", headers={"Cookie": f"n=0{n}"}).status_code == 200
    assert httpx.get(f"{gateway.url}/cart", headers={"Cookie": f'n="{n}"'}).status_code == 429


def test_a_float_is_counted_as_the_number(gateway: GatewayProcess) -> None:
    n = item()
    statuses = [httpx.get(f"{gateway.url}/price/{s}").status_code for s in (f"{n}.5", f"0{n}.50", f"{n}.500")]
    assert statuses == [200, 429, 429]
    whole = [httpx.get(f"{gateway.url}/price/{s}").status_code for s in (f"{n}", f"{n}.0", f"0{n}.")]
    assert whole[:2] == [200, 429]
    assert whole[2] == 400  # '7.' : readers disagree, refused


def test_a_source_typed_in_by_reads_an_untyped_template_as_the_number(gateway: GatewayProcess) -> None:
    n = item()
    assert [httpx.get(f"{gateway.url}/lot/{s}").status_code for s in (f"{n}", f"0{n}")] == [200, 429]


@pytest.mark.parametrize(("where", "request_of"), [
    ("query", lambda url, v: httpx.post(f"{url}/orders", params={"item": v})),
    ("header", lambda url, v: httpx.post(f"{url}/claim", headers={"X-Item": v})),
    ("cookie", lambda url, v: httpx.get(f"{url}/cart", headers={"Cookie": f"n={v}"})),
])
@pytest.mark.parametrize("spelling", ["+{n}", "{n}.0", "{n}_1", "-{n}", "{n}e0", "0x{n}", "abc"])
def test_other_spellings_of_a_typed_source_are_refused(gateway: GatewayProcess, where: str,
                                                       request_of: Any, spelling: str) -> None:
    value = spelling.format(n=item())
    response = request_of(gateway.url, value)
    assert response.status_code == 400, (where, value, response.text)
    assert "plain decimal digits" in response.json()["detail"]
    assert "x-upstream" not in response.headers


def test_gateway_check_warns_of_a_stock_counted_by_an_untyped_path_parameter(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("""\
version: 1
upstreams: {shop: {url: "http://127.0.0.1:9"}}
routes:
  - name: seckill
    match: {path: "/seckill/{item_id}"}
    upstream: shop
    limits:
      - {name: stock, by: [path:item_id], algorithm: quota, limit: 100}
  - name: typed
    match: {path: "/typed/{item_id:int}"}
    upstream: shop
    limits: [{name: stock, by: [path:item_id], algorithm: quota, limit: 100}]
""")
    checked = subprocess.run([sys.executable, "-m", "gateway", "check", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    warnings = [line for line in checked.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, checked.stderr
    assert "routes[0](seckill).limits[0](stock).by[0]" in warnings[0] and "{item_id:int}" in warnings[0]
    assert f"{config}:8:" in warnings[0]


def test_the_shipped_routes_file_checks_without_a_warning() -> None:
    shipped = Path(__file__).parent.parent / "routes.yaml"
    checked = subprocess.run([sys.executable, "-m", "gateway", "check", str(shipped)], capture_output=True, text=True)
    assert checked.returncode == 0 and "warning" not in checked.stderr, checked.stderr
