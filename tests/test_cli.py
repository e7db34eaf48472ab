"""The command line: `gateway check`, `gateway serve` refusing a bad config, settings precedence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import parse_args, resolve_settings
from gateway.settings import ENV_KEYS, Settings, boolean, from_env

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)


def test_check_accepts_the_repository_routes() -> None:
    result = run("check", "routes.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "routes.yaml: ok (7 routes, 14 rules, 1 upstream)"


def test_check_lists_every_error_with_file_line_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nupstreams: {shop: {url: 'http://x:1'}}\nroutes:\n"
                   "  - {name: a, match: {path: /a}, upstream: nowhere}\n"
                   "  - {name: b, match: {path: /b}, upstream: shop, colour: red}\n")
    result = run("check", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"{bad}:4: routes[0](a).upstream: no upstream named 'nowhere' (known: shop)"
    assert lines[1].startswith(f"{bad}:5: routes[1].colour: unknown key")
    assert lines[-1] == f"{bad}: 2 error(s)"


def test_serve_refuses_a_bad_config_without_starting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\n")
    result = run("serve", "--config", str(bad), "--port", "0", "--admin-port", "1")
    assert result.returncode == 2
    assert "upstreams: is required" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_the_same_port_for_proxy_and_admin() -> None:
    result = run("serve", "--port", "9999", "--admin-port", "9999")
    assert result.returncode == 2 and "ports must all differ" in result.stderr
    result = run("serve", "--port", "9999", "--admin-port", "9998", "--check-port", "9998")
    assert result.returncode == 2 and "ports must all differ" in result.stderr


def test_bad_environment_value_is_a_clear_error() -> None:
    result = run("serve", env={"GATEWAY_PORT": "eighty", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "GATEWAY_PORT='eighty'" in result.stderr


def test_comparison_implementations_are_not_product_settings() -> None:
    """uvicorn's protocol and httpx's transport are built by tests and bench, never chosen by env."""
    assert not any(name.startswith(("GATEWAY_HTTP", "GATEWAY_UPSTREAM")) for name in ENV_KEYS)
    assert from_env({"GATEWAY_HTTP": "uvicorn", "GATEWAY_UPSTREAM_TRANSPORT": "httpx"}) == from_env({})


def test_environment_overrides_defaults_and_flags_override_environment() -> None:
    env = {"GATEWAY_PORT": "8181", "GATEWAY_ADMIN_PORT": "9191", "GATEWAY_WORKERS": "3",
           "GATEWAY_REDIS_URL": "redis://r:6379", "GATEWAY_CONFIG": "/etc/gw.yaml", "GATEWAY_LOG_LEVEL": "debug"}
    settings = from_env(env)
    assert settings == Settings(config_path="/etc/gw.yaml", port=8181, admin_port=9191, workers=3,
                                redis_url="redis://r:6379", log_level="debug")
    assert from_env({}) == Settings()
    with pytest.raises(ValueError, match="GATEWAY_WORKERS"):
        from_env({"GATEWAY_WORKERS": "many"})


def test_flags_override_the_environment() -> None:
    env = {"GATEWAY_PORT": "8181", "GATEWAY_WORKERS": "3", "GATEWAY_REDIS_URL": "redis://env:1"}
    args = parse_args(["serve", "--port", "7070", "--redis-url", "redis://flag:2", "--admin-host", "127.0.0.1"])
    settings = resolve_settings(args, env)
    assert (settings.port, settings.workers, settings.redis_url) == (7070, 3, "redis://flag:2")
    assert settings.effective_admin_host == "127.0.0.1" and settings.host == "0.0.0.0"


def test_help_names_both_commands() -> None:
    result = run("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout and "check" in result.stdout


def test_check_without_a_path_reads_what_serve_would(tmp_path: Path) -> None:
    """routes.yaml in the current directory, or GATEWAY_CONFIG, as `gateway serve` (issue 23)."""
    env = {"PATH": "/usr/bin:/bin"}
    here = subprocess.run([sys.executable, "-m", "gateway", "check"], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip() == "routes.yaml: ok (7 routes, 14 rules, 1 upstream)"
    one = tmp_path / "one.yaml"
    one.write_text("version: 1\nupstreams: {a: {url: 'http://x:1'}, b: {url: 'http://y:1'}}\nroutes:\n"
                   "  - {name: r, match: {path: /r}, upstream: a,\n"
                   "     limits: [{name: g, by: [], algorithm: gcra, rate: 1/s, burst: 1}]}\n")
    named = subprocess.run([sys.executable, "-m", "gateway", "check"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env={**env, "GATEWAY_CONFIG": str(one)})
    assert named.returncode == 0, named.stderr
    assert named.stdout.strip() == f"{one}: ok (1 route, 1 rule, 2 upstreams)"
    nowhere = subprocess.run([sys.executable, "-m", "gateway", "check"], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path, env=env)
    assert nowhere.returncode == 2
    assert str(tmp_path / "routes.yaml") in nowhere.stderr and "GATEWAY_CONFIG" in nowhere.stderr
    assert "Traceback" not in nowhere.stderr


# --- the settings table: flags, environment, docs and chart from one place ------------------------

def test_every_setting_is_in_the_table_once_and_the_table_names_only_settings() -> None:
    from dataclasses import fields

    from gateway.settings import OPTIONS

    names = [option.field for option in OPTIONS]
    assert sorted(names) == sorted({f.name for f in fields(Settings)} - {"embedded_redis_url"})  # supervisor's own
    assert len({option.env for option in OPTIONS}) == len(OPTIONS)
    assert all(option.env.startswith("GATEWAY_") for option in OPTIONS)


def test_help_shows_each_flag_with_its_environment_variable_and_default() -> None:
    from gateway.settings import OPTIONS

    text = " ".join(run("serve", "--help").stdout.split())
    for option in OPTIONS:
        if option.flag is not None and option.switch:
            assert f"{option.flag} {option.help}" in text and f"(env {option.env}=1)" in text, option.field
        elif option.flag is not None:
            assert f"{option.flag} {option.shown_metavar}" in text
            assert f"env {option.env}; default {option.shown_default()})" in text, option.field


def test_each_flag_and_each_variable_sets_its_setting() -> None:
    from gateway.settings import OPTIONS
    from gateway.urls import redis_url

    samples: dict[object, str] = {int: "7", float: "2.5", str: "/some/value", boolean: "1",
                                  redis_url: "redis://cache:6380/2"}
    for option in OPTIONS:
        expected = option.kind(samples[option.kind])
        assert getattr(from_env({option.env: samples[option.kind]}), option.field) == expected, option.env
        if option.flag is not None:
            given = [option.flag] if option.switch else [option.flag, samples[option.kind]]
            settings = resolve_settings(parse_args(["serve", *given]), {})
            assert getattr(settings, option.field) == expected, option.flag


def test_ephemeral_and_a_data_dir_exclude_each_other() -> None:
    result = run("serve", "--ephemeral", "--data-dir", "/tmp/x")
    assert result.returncode == 2 and "exclude each other" in result.stderr


def test_the_chart_sets_each_setting_it_names_with_the_same_default() -> None:
    import yaml

    from gateway.settings import OPTIONS

    chart = REPO / "helm" / "gateway"
    template = (chart / "templates" / "deployment.yaml").read_text()
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for option in OPTIONS:
        if option.chart is None:
            continue
        assert f"- name: {option.env}\n" in template, option.env
        assert f".Values.{option.chart}" in template, option.chart
        value = values
        for part in option.chart.split("."):
            value = value[part]
        if option.default is not None and not option.chart.endswith(("containerPort", "secretName", "url")):
            assert option.kind(value) == option.default, (option.chart, value, option.default)


COUNTED_BY_THE_ANSWER = """\
version: 1
upstreams: {shop: {url: "http://127.0.0.1:9"}}
routes:
  - name: pay
    match: {path: /pay}
    upstream: shop
    limits: [{name: ok-only, by: [ip], algorithm: fixed_window, limit: 5, window: 1m, count_on: [200]}]
"""


def test_check_sees_what_the_check_port_refuses_from_a_flag_or_the_file(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(COUNTED_BY_THE_ANSWER)
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    assert run("check", str(path), env=clean).returncode == 0  # the proxy port alone counts by the answer
    flagged = run("check", "--check-port", "8081", str(path), env=clean)
    assert flagged.returncode == 2 and "count_on" in flagged.stderr, flagged.stderr
    path.write_text(COUNTED_BY_THE_ANSWER + "check: {convention: auto}\n")
    sectioned = run("check", str(path), env=clean)
    assert sectioned.returncode == 2 and "count_on" in sectioned.stderr, sectioned.stderr
    assert run("check", "--rls-port", "8082", "routes.yaml", env=clean).returncode == 0
    bad = run("check", "--check-port", "eighty", "routes.yaml", env=clean)
    assert bad.returncode == 2 and "--check-port" in bad.stderr


def test_a_check_only_file_needs_no_upstream(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text("version: 1\ncheck: {convention: auto}\nroutes:\n"
                    "  - name: search\n    match: {path: /search}\n"
                    "    limits: [{name: per-ip, by: [ip], algorithm: fixed_window, limit: 5, window: 1m}]\n")
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    result = run("check", str(path), env=clean)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{path}: ok (1 route, 1 rule, 0 upstreams)"
    proxied = tmp_path / "proxied.yaml"  # without the check port, a route still needs its upstream
    proxied.write_text(path.read_text().replace("check: {convention: auto}\n", ""))
    missing = run("check", str(proxied), env=clean)
    assert missing.returncode == 2 and "upstream" in missing.stderr, missing.stderr
