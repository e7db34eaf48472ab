"""The method the upstream acts on is the method counted, on the proxy port and the check port.

HEAD is GET without the body, served by the upstream's GET handler (Starlette, aiohttp, nginx and
Express all do): a route that lists GET takes HEAD, counts it as GET and forwards it as HEAD.
Before, the proxy port answered it 405 and the check port "no route" 200 (so nginx and Caddy let
five HEADs past a spent GET limit). A method-override field (X-HTTP-Method-Override and its
siblings) is matched and counted as the method it names unless the route says
`method_override: ignore`. The gateway is a real process; the upstream a real aiohttp server,
which serves HEAD with its GET handler."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

CONFIG = """\
version: 1
trusted_proxies: [127.0.0.1/32]
check: {{path_prefix: /check}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: search
    match: {{path: /search, methods: [GET]}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 2}}]
  - name: orders
    match: {{path: /orders, methods: [DELETE]}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 1}}]
  - name: literal
    match: {{path: /literal, methods: [GET]}}
    upstream: up
    method_override: ignore
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 1}}]
  - name: cart-write
    match: {{path: /cart, methods: [POST]}}
    upstream: up
    limits: [{{name: user, by: [header:X-User-Id], algorithm: quota, limit: 1}}]
  - name: cart-read
    match: {{path: /cart, methods: [GET]}}
    upstream: up
  - name: by-method
    match: {{path: /by-method}}
    upstream: up
    limits: [{{name: m, by: [method, header:X-User-Id], algorithm: quota, limit: 1}}]
  - name: stock
    match: {{path: "/stock/{{item:int}}", methods: [POST]}}
    upstream: up
    limits: [{{name: units, by: [path:item], algorithm: quota, limit: 1}}]
  - name: everything
    match: {{path: "/{{rest:path}}"}}
    upstream: up
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            upstream: Upstream) -> Iterator[GatewayProcess]:
    check_port = free_port()
    process = GatewayProcess(CONFIG.format(upstream=upstream.url), tmp_path_factory.mktemp("methods"),
                             redis_url=redis_proc.url, args=("--check-port", str(check_port)))
    process.check_url = f"http://127.0.0.1:{check_port}"  # type: ignore[attr-defined]
    process.start()
    try:
        yield process
    finally:
        process.stop()
    assert "Traceback" not in process.log()


def user() -> dict[str, str]:
    return {"X-User-Id": f"u{random.randrange(10**9)}"}


def test_head_on_a_get_route_is_forwarded_as_head_and_counted_as_get(gateway: GatewayProcess) -> None:
    who = user()
    head = httpx.head(f"{gateway.url}/search", headers=who)
    assert head.status_code == 200, head.text  # before: 405
    assert head.headers["x-upstream"] == "echo"  # the upstream's GET handler answered it
    assert head.headers["ratelimit-policy"].startswith('"user"')
    assert httpx.get(f"{gateway.url}/search", headers=who).status_code == 200
    assert httpx.get(f"{gateway.url}/search", headers=who).status_code == 429  # the HEAD took one of two
    refused = httpx.head(f"{gateway.url}/search", headers=who)
    assert refused.status_code == 429
    assert "x-upstream" not in refused.headers


def test_head_after_a_spent_get_limit_is_refused(gateway: GatewayProcess) -> None:
    who = user()
    assert [httpx.get(f"{gateway.url}/search", headers=who).status_code for _ in range(3)] == [200, 200, 429]
    assert [httpx.head(f"{gateway.url}/search", headers=who).status_code for _ in range(5)] == [429] * 5


def test_a_405_names_head_with_get(gateway: GatewayProcess) -> None:
    refused = httpx.post(f"{gateway.url}/search", headers=user())
    assert refused.status_code == 405
    assert refused.headers["allow"] == "GET, HEAD"


def test_the_check_port_counts_head_as_get(gateway: GatewayProcess) -> None:
    check = gateway.check_url  # type: ignore[attr-defined]
    who = user()

    def ask(method: str) -> int:
        headers = {**who, "X-Forwarded-Method": method, "X-Forwarded-Uri": "/search",
                   "X-Forwarded-Host": "shop.example"}
        return httpx.get(f"{check}/check", headers=headers).status_code

    assert [ask("GET"), ask("GET"), ask("GET")] == [200, 200, 429]
    assert [ask("HEAD") for _ in range(5)] == [429] * 5  # before: 200, "no route"


def test_an_override_is_counted_as_the_method_it_names(gateway: GatewayProcess) -> None:
    who = user()
    assert httpx.get(f"{gateway.url}/search", headers=who).status_code == 200
    assert httpx.get(f"{gateway.url}/search", headers=who).status_code == 200
    for name in ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"):
        refused = httpx.post(f"{gateway.url}/search", headers={**who, name: "get"})
        assert refused.status_code == 429, (name, refused.text)  # before: the catch-all's, uncounted


def test_an_override_reaches_a_route_that_owns_the_named_method(gateway: GatewayProcess) -> None:
    who = user()
    first = httpx.post(f"{gateway.url}/orders", headers={**who, "X-HTTP-Method-Override": "DELETE"})
    assert first.status_code == 200
    assert first.json()["method"] == "POST"  # forwarded as sent: the upstream reads the field itself
    assert ["x-http-method-override", "DELETE"] in first.json()["headers"]
    assert httpx.delete(f"{gateway.url}/orders", headers=who).status_code == 429  # one counter


def test_a_route_that_ignores_overrides_matches_the_request_line(gateway: GatewayProcess) -> None:
    who = user()
    overridden = httpx.post(f"{gateway.url}/literal", headers={**who, "X-HTTP-Method-Override": "GET"})
    assert overridden.status_code == 405  # a POST, as this route's upstream reads it
    assert httpx.get(f"{gateway.url}/literal", headers=who).status_code == 200
    assert httpx.head(f"{gateway.url}/literal", headers=who).status_code == 429  # HEAD is GET regardless


def test_the_method_identity_is_the_counted_method(gateway: GatewayProcess) -> None:
    who = user()
    assert httpx.get(f"{gateway.url}/by-method", headers=who).status_code == 200
    assert httpx.head(f"{gateway.url}/by-method", headers=who).status_code == 429
    assert httpx.post(f"{gateway.url}/by-method", headers={**who, "X-HTTP-Method-Override": "GET"}).status_code == 429
    assert httpx.post(f"{gateway.url}/by-method", headers=who).status_code == 200


def test_an_override_whose_route_differs_from_the_request_lines_is_refused(gateway: GatewayProcess) -> None:
    """POST /cart is limited, GET /cart is not: an upstream that honours no override runs the POST
    handler for a POST naming GET, so counting it as GET would walk past the POST limit."""
    who = user()
    walked = httpx.post(f"{gateway.url}/cart", headers={**who, "X-HTTP-Method-Override": "GET"})
    assert walked.status_code == 400, walked.text
    assert "may act on either" in walked.json()["detail"]
    assert "x-upstream" not in walked.headers
    assert httpx.post(f"{gateway.url}/cart", headers=who).status_code == 200
    assert httpx.post(f"{gateway.url}/cart", headers=who).status_code == 429


def test_an_override_naming_a_method_no_route_takes_is_refused_on_every_port(gateway: GatewayProcess) -> None:
    """POST /stock/N is limited and nothing else is routed there: a POST naming PUT was a 405 on the
    proxy port but a 200 "no route" on the check port (and the middleware's app's), while an upstream
    that honours no override sells the POST (an outside probe: the stock oversold)."""
    check = gateway.check_url  # type: ignore[attr-defined]
    item = f"/stock/{random.randrange(10**9)}"

    def ask(**override: str) -> httpx.Response:
        headers = {"X-Forwarded-Method": "POST", "X-Forwarded-Uri": item, "X-Forwarded-Host": "shop.example"}
        return httpx.get(f"{check}/check", headers={**headers, **override})

    assert ask().status_code == 200
    assert ask().status_code == 429  # the one unit is sold
    for name in ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"):
        for method in ("PUT", "GET", "DELETE"):
            walked = ask(**{name: method})
            assert walked.status_code == 400, (name, method, walked.text)  # before: 200
            assert "may act on either" in walked.json()["detail"]
    proxied = httpx.post(f"{gateway.url}/stock/{random.randrange(10**9)}", headers={"X-HTTP-Method-Override": "PUT"})
    assert proxied.status_code == 400 and "x-upstream" not in proxied.headers
    assert httpx.put(f"{gateway.url}{item}").status_code == 405  # no override: the route owns the path


@pytest.mark.parametrize("headers", [
    {"X-HTTP-Method-Override": "GET", "X-HTTP-Method": "DELETE"},
    {"X-HTTP-Method-Override": "GET", "X_HTTP_Method_Override": "DELETE"},
    {"X_HTTP_Method_Override": "GET"},  # an override to a CGI-style upstream, not to Starlette
    {"X-HTTP-Method-Override": "G E T"},
    {"X-HTTP-Method-Override": ""},
])
def test_overrides_that_cannot_be_read_as_one_method_are_refused(gateway: GatewayProcess,
                                                                 headers: dict[str, str]) -> None:
    refused = httpx.post(f"{gateway.url}/search", headers={**user(), **headers})
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert "x-upstream" not in refused.headers


def test_a_repeated_override_is_refused(gateway: GatewayProcess) -> None:
    headers = [("X-User-Id", "r1"), ("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method-Override", "GET")]
    refused = httpx.post(f"{gateway.url}/search", headers=headers)
    assert refused.status_code == 400

