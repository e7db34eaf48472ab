"""routes.yaml -> Config: one fixture file per failure (tests/loader_cases), each naming the line,
the key and the message it must produce; the repository's routes.yaml as the positive case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Source, load_config, parse_config
from gateway.errors import ConfigError

CASES = Path(__file__).parent / "loader_cases"
REPO = Path(__file__).resolve().parent.parent


def _expectation(path: Path) -> tuple[int, str, str]:
    lines = path.read_text().splitlines()
    marker, key, message = (part.strip() for part in lines[0].removeprefix("# expect:").split("|"))
    if marker == "(end)":
        return len(lines), key, message
    line = next(i for i, text in enumerate(lines[1:], start=2) if marker in text)
    return line, key, message


@pytest.mark.parametrize("case", sorted(CASES.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_bad_file_names_its_file_line_and_key(case: Path) -> None:
    line, key, message = _expectation(case)
    with pytest.raises(ConfigError) as caught:
        load_config(case, env={})
    problems = caught.value.problems
    assert all(p.file == str(case) for p in problems)
    matching = [p for p in problems if key in p.key and message in p.message]
    assert matching, f"no problem with key ~{key!r} and message ~{message!r} in:\n{caught.value}"
    assert any(p.line in (line, line + 1) if key == "(document)" else p.line == line for p in matching), \
        f"expected line {line}:\n{caught.value}"


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text(
        "version: 1\nupstreams: {shop: {url: 'http://x:1'}}\nroutes:\n"
        "  - {name: a, match: {path: /a}, upstream: nowhere}\n"
        "  - name: b\n    match: {path: /b}\n    upstream: shop\n    limits:\n"
        "      - {name: u, by: [ip], algorithm: fixed_window, limit: 0, window: 1s}\n"
        "      - {name: v, by: [cookie], algorithm: gcra, rate: 1/s, burst: 1}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    lines = sorted(p.line for p in caught.value.problems)
    assert lines == [4, 9, 10]


def test_oversized_and_binary_files_are_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# padding\n" * 500_000)
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        load_config(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(binary)
    deep = tmp_path / "deep.yaml"
    deep.write_text("version: 1\nx: " + "[" * 200 + "]" * 200 + "\n")
    with pytest.raises(ConfigError, match="too deeply nested"):
        load_config(deep)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(empty)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_repository_routes_yaml_loads_into_the_expected_objects() -> None:
    config = load_config(REPO / "routes.yaml", env={})
    assert config.redis.url == "" and config.redis.timeout == 0.05 and config.redis.key_prefix == "rlgw"
    assert [r.name for r in config.routes] == ["seckill", "login", "notifications", "chat", "internal", "api-pro",
                                               "api"]
    seckill, login, notifications, chat, internal, pro, api = config.routes
    assert [(r.reserve_field, r.cost, r.settle_field) for r in chat.limits] == [
        (("max_tokens",), 200, ("usage", "total_tokens"))] * 2
    assert login.limits[0].count_on == frozenset({401}) and login.limits[0].charged_after
    assert notifications.websocket and not seckill.websocket and not api.websocket
    assert notifications.websocket_idle_timeout == 600.0 and api.websocket_idle_timeout == 3600.0
    assert [str(n) for n in internal.when.client] == ["10.0.0.0/8", "192.168.0.0/16"] and not internal.limits
    assert pro.when.headers == ((b"x-api-key", frozenset({b"pro-key-123"})),)
    assert seckill.methods == frozenset({"POST"}) and seckill.path == "/seckill/{item_id:int}"
    assert seckill.failure_mode == "closed" and api.failure_mode == "open"
    assert api.headers == "draft"
    user, item, stock, dedupe = seckill.limits
    assert (user.algorithm, user.rate, user.burst) == ("token_bucket", 5.0, 5)
    assert user.by == (Source("header", "x-user-id"),)
    assert (item.algorithm, item.limit, item.window) == ("sliding_window", 1000, 1.0)
    assert (stock.algorithm, stock.limit, stock.window) == ("quota", 100, 0.0)
    assert stock.refund_on == frozenset(range(500, 600))
    assert dedupe.by == (Source("header", "x-user-id"), Source("body")) and dedupe.status == 409
    assert [r.window for r in api.limits[:2]] == [60.0, 120.0]
    assert api.limits[2].rate == 2000.0 and api.limits[2].by == ()
    assert config.trusted_proxies == (), "the example believes nobody's X-Forwarded-For"
    assert config.upstreams["shop"].url == "http://127.0.0.1:9000"


def test_environment_interpolation() -> None:
    text = (
        "version: 1\nredis: {url: '${R_URL}', key_prefix: '${PFX:-gw}'}\n"
        "upstreams: {shop: {url: 'http://${HOST:-127.0.0.1}:${PORT}'}}\n"
        "routes: [{name: a, match: {path: /a}, upstream: shop}]\n"
    )
    config = parse_config(text, "t.yaml", {"R_URL": "redis://h:1/2", "PORT": "81"})
    assert config.redis.url == "redis://h:1/2" and config.redis.key_prefix == "gw"
    assert config.upstreams["shop"].url == "http://127.0.0.1:81"
    assert load_config(REPO / "routes.yaml", env=dict(os.environ, SHOP_URL="http://10.1.2.3:80")) \
        .upstreams["shop"].url == "http://10.1.2.3:80"


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_give_a_config_error_never_a_crash(data: bytes) -> None:
    try:
        parse_config(data, "fuzz.yaml", {})
    except ConfigError as exc:
        assert exc.problems and all(p.file == "fuzz.yaml" and p.line >= 0 and p.key for p in exc.problems)


KEYS = ["version", "redis", "defaults", "upstreams", "routes", "name", "match", "path", "upstream",
        "limits", "by", "algorithm", "limit", "window", "rate", "burst", "cost", "status", "shadow",
        "on_missing", "url", "timeout", "mode", "methods", "period", "trusted_proxies"]
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False),
              st.sampled_from(["1s", "5/s", "ip", "header:X", "quota", "gcra", "/a/{x}", "http://h:1",
                               "${X}", "{", "", "shop"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=7))
def test_random_documents_give_a_config_or_a_config_error(document: dict[str, object]) -> None:
    import yaml

    text = yaml.safe_dump(document)
    try:
        parse_config(text, "fuzz.yaml", {})
    except ConfigError as exc:
        assert exc.problems and all(p.line >= 0 and p.key for p in exc.problems)


@pytest.mark.parametrize(("field", "url", "key"), [
    ("upstream", "http://127.0.0.1:99999", "upstreams.shop.url"),
    ("upstream", "http://127.0.0.1:0", "upstreams.shop.url"),
    ("upstream", "https://shop.example:http", "upstreams.shop.url"),
    ("redis", "redis://127.0.0.1:99999", "redis.url"),
    ("redis", "rediss://cache:-1", "redis.url"),
])
def test_a_url_naming_no_port_a_client_can_connect_to_is_refused(tmp_path: Path, field: str, url: str,
                                                                 key: str) -> None:
    """Before, `gateway check` passed them: an upstream's was a request that never got its answer, a
    Redis's a worker that restarted for ever (an outside probe)."""
    shop = url if field == "upstream" else "http://127.0.0.1:9000"
    redis = f"redis: {{url: '{url}'}}\n" if field == "redis" else ""
    path = tmp_path / "routes.yaml"
    path.write_text(f"version: 1\n{redis}upstreams:\n  shop: {{url: '{shop}'}}\n"
                    "routes:\n  - {name: a, match: {path: /a}, upstream: shop}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert any(key in p.key and "port" in p.message for p in caught.value.problems), caught.value


def test_a_redis_url_flag_or_variable_naming_no_port_is_refused_before_anything_starts() -> None:
    import subprocess
    import sys

    flag = subprocess.run([sys.executable, "-m", "gateway", "serve", "--redis-url", "redis://127.0.0.1:99999",
                           "--config", str(REPO / "routes.yaml")], capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and "argument --redis-url: invalid" in flag.stderr, flag.stderr
    env = {**os.environ, "GATEWAY_REDIS_URL": "redis://127.0.0.1:99999"}
    variable = subprocess.run([sys.executable, "-m", "gateway", "check", str(REPO / "routes.yaml")],
                              capture_output=True, text=True, timeout=60, env=env)
    assert variable.returncode == 2 and "GATEWAY_REDIS_URL" in variable.stderr, variable.stderr


@pytest.mark.parametrize(("match", "words"), [
    ("{path: /a, host: 'shop.example:8080'}", "without its port"),
    ("{path: /a, host: '*.shop.example'}", "wildcards"),
    ("{path: '/q?x=1'}", "without a query"),
    ("{path: '/x/../y'}", "dot segments"),
    ("{path: '/m//n'}", "repeated slashes"),
    ("{path: '/m/./n'}", "dot segments"),
])
def test_a_match_no_request_could_meet_is_refused(tmp_path: Path, match: str, words: str) -> None:
    """Requests are matched on their path after normalization and on their host without its port:
    such a route never matched, and its requests went on to a later route, past its limits (an
    outside probe: `gateway check` passed them)."""
    path = tmp_path / "routes.yaml"
    path.write_text("version: 1\nupstreams: {shop: {url: 'http://127.0.0.1:9000'}}\n"
                    f"routes:\n  - {{name: a, match: {match}, upstream: shop}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert any(p.line == 4 and words in p.message for p in caught.value.problems), caught.value


def test_a_host_is_read_as_requests_name_it() -> None:
    """Upper case, a trailing dot and an internationalized name: what clients send (xn--) matches."""
    for written, read in [("Shop.Example.", "shop.example"), ("bücher.example", "xn--bcher-kva.example"),
                          ("[::1]", "[::1]")]:
        config = parse_config("version: 1\nupstreams: {shop: {url: 'http://127.0.0.1:9000'}}\n"
                              f"routes:\n  - {{name: a, match: {{path: /a, host: '{written}'}}, upstream: shop}}\n",
                              "routes.yaml", {})
        assert config.routes[0].host == read
