"""Small things a new user trips over: `make run` on this machine only, a start without a
warning, statuses shown as the file wrote them, a migration doc that lists what the loader takes, a
quoted requests_per_unit named, and a calendar month's `w` as long as this month."""

from __future__ import annotations

import calendar
import importlib.util
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent


def test_make_run_listens_on_this_machine_only() -> None:
    venv = Path(sys.executable).parent.parent
    shown = subprocess.run(["make", "-n", "--no-print-directory", "run", "-o", f"{venv}/.installed-run",
                            f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert "scripts/run.py --host 127.0.0.1" in shown.stdout, shown.stdout
    spec = importlib.util.spec_from_file_location("run_script", ROOT / "scripts" / "run.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv, host in (([], "127.0.0.1"), (["--port", "8081"], "127.0.0.1"), (["--host", "0.0.0.0"], "0.0.0.0")):
        command = script.gateway_command(script.parse_args(argv))
        assert command[command.index("--host") + 1] == host, command


CONFIG = """
version: 1
redis: {{key_prefix: {prefix}}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: pay
    match: {{path: /echo/pay}}
    upstream: up
    limits:
      - {{name: errors, by: [ip], algorithm: fixed_window, limit: 5, window: 1m, count_on: [5xx, 429]}}
      - {{name: monthly, by: [ip], algorithm: quota, limit: 1000, period: month}}
"""


def test_a_start_warns_of_nothing_and_shows_the_file_as_written(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> None:
    gateway = GatewayProcess(CONFIG.format(prefix=f"s{uuid.uuid4().hex[:8]}", upstream=upstream.url), tmp_path,
                             redis_url=redis_proc.url, workers=2)
    gateway.start()
    try:
        rules = httpx.get(gateway.admin_url + "/limits").json()["routes"][0]["rules"]
        assert rules[0]["count_on"] == [429, "5xx"]
        before = time.gmtime()
        answer = httpx.get(gateway.url + "/echo/pay")
        after = time.gmtime()
        lengths = {86_400 * calendar.monthrange(t.tm_year, t.tm_mon)[1] for t in (before, after)}
        policy = answer.headers["ratelimit-policy"]
        month = re.search(r'"monthly";q=1000;w=(\d+)', policy)
        assert month is not None and int(month.group(1)) in lengths, policy
    finally:
        assert gateway.stop() == 0
    log = gateway.log()
    assert "Warning" not in log and "warnings.warn" not in log, log


def _native_algorithms() -> list[str]:
    text = (ROOT / "docs" / "migrating-from-envoy-ratelimit.md").read_text()
    listed = text[text.index("counted by a rule of"):]
    listed = listed[:listed.index("with any window")]
    return re.findall(r"`([a-z_]+)`", listed)


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "sliding_window", "sliding_log", "fixed_window",
                                       "quota", "leaky_bucket", "concurrency"])
def test_the_migration_doc_lists_the_algorithms_a_native_domain_takes(algorithm: str) -> None:
    numbers = "rate: 10/s, burst: 5" if algorithm in ("token_bucket", "gcra", "leaky_bucket") else "limit: 5"
    window = ", window: 1m" if algorithm in ("sliding_window", "sliding_log", "fixed_window") else ""
    text = (f"version: 1\nrls:\n  domains:\n    api:\n      descriptors:\n        - key: k\n"
            f"          limit: {{name: n, algorithm: {algorithm}, {numbers}{window}}}\n")
    try:
        parse_config(text, "routes.yaml", {})
        taken = True
    except ConfigError:
        taken = False
    assert (algorithm in _native_algorithms()) == taken, (algorithm, _native_algorithms())


def test_a_quoted_requests_per_unit_is_named_with_its_file_line_and_key(tmp_path: Path) -> None:
    (tmp_path / "ratelimit").mkdir()
    (tmp_path / "ratelimit" / "config.yaml").write_text(
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n"
        '      requests_per_unit: "5"\n')
    (tmp_path / "routes.yaml").write_text("version: 1\nrls: {files: [ratelimit/config.yaml]}\n")
    result = subprocess.run([sys.executable, "-m", "gateway", "check", str(tmp_path / "routes.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert (f"{tmp_path / 'ratelimit' / 'config.yaml'}:6: descriptors[0].rate_limit.requests_per_unit: "
            "is the string '5'") in result.stderr, result.stderr
