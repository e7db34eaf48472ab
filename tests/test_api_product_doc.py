"""Every command of docs/operations.md's "Running an API product" walk-through, run as written against a
gateway serving the routes file that section shows (forwarding to the example backend, with a Redis of
its own), with what each comment says checked: the status, the JSON fields it names (`"remaining":
99997` is a field of that name with that value somewhere in the answer), or the text after `prints:`.
Only the ports are changed (the test's own). The walk-through says a key applies within a second: a
command to the proxy port whose status is not yet the one shown is asked again until it is, for at
most two seconds (the bound the API keys promise); none of those asked again is charged (an unknown
key's 401 reaches no rule, and the usage route charges nothing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_for_port, wait_until

pytestmark = pytest.mark.clock_windows  # its walk-through counts under a calendar month (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## Running an API product"
APPLIES_WITHIN = 2.0
STATUS = re.compile(r"@status=(\d{3})")
CURL = "curl() { command curl -sS -w '\\n@status=%{http_code}\\n' \"$@\"; }\n"
FIELD = re.compile(r'"([A-Za-z_][\w-]*)": ("[^"]*"|-?\d+|true|false|null)')


def section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index(TITLE)
    end = text.find("\n## ", start + len(TITLE))
    return text[start:end if end >= 0 else None]


def commands() -> tuple[str, list[tuple[str, str]]]:
    """The variables line, and every (command, comment) of the section's ```sh blocks."""
    variables, out = "", []
    for block in re.findall(r"```sh\n(.*?)```", section(), re.S):
        for line in block.splitlines():
            if line.startswith("ADMIN="):
                variables = line
                continue
            command, _, comment = line.partition("  # ")
            if command.strip():
                out.append((command.strip(), comment.strip()))
    return variables, out


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    routes = re.findall(r"```yaml\n(.*?)```", section(), re.S)[0]
    port = free_port()
    backend = started([sys.executable, "-m", "gateway.example_backend", "--port", str(port)],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    redis = RedisProcess()  # its own: the walk-through's keys and counts start from nothing
    redis.start()
    gateway = GatewayProcess(routes, tmp_path_factory.mktemp("api-product"), redis_url=redis.url,
                             env={"SHOP_URL": f"http://127.0.0.1:{port}"})
    try:
        wait_for_port(port, backend)
        gateway.start()
        yield gateway
    finally:
        gateway.stop()
        backend.terminate()
        backend.wait(10)
        redis.stop()


def run(gateway: GatewayProcess, variables: str, command: str) -> str:
    variables = (variables.replace("localhost:8080", f"127.0.0.1:{gateway.port}")
                 .replace("localhost:9090", f"127.0.0.1:{gateway.admin_port}"))
    done = subprocess.run(["bash", "-c", CURL + variables + "\n" + command], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def holds(found: Any, name: str, value: Any) -> bool:
    """Whether the JSON answer has a field `name` equal to `value`, at any depth."""
    if isinstance(found, dict):
        return any((k == name and v == value) or holds(v, name, value) for k, v in found.items())
    if isinstance(found, list):
        return any(holds(item, name, value) for item in found)
    return False


def says(out: str, comment: str) -> bool:
    """Whether `out` (a command's output) is what its comment says."""
    if comment.startswith("prints: "):
        return comment.removeprefix("prints: ") in out
    status = STATUS.findall(out)
    if not status or status[-1] != comment[:3]:
        return False
    fields = FIELD.findall(comment)
    if not fields:
        return True
    body = json.loads(out.rsplit("\n@status=", 1)[0])
    return all(holds(body, name, json.loads(value)) for name, value in fields)


def test_the_api_product_walk_through_does_what_its_comments_say(running: GatewayProcess) -> None:
    variables, listed = commands()
    assert variables and len(listed) >= 14
    assert any("/consumers/" in c for c, _ in listed) and any("unknown_key" in c for c, _ in listed)
    for command, comment in listed:
        assert re.match(r"(\d{3}\b|prints: )", comment), (command, comment)  # every command says what it shows
        out = run(running, variables, command)
        if not says(out, comment) and "$API" in command:  # a key written a moment ago: applied within 2 s
            wait_until(lambda: says(run(running, variables, command), comment), timeout=APPLIES_WITHIN)  # noqa: B023
            continue
        assert says(out, comment), (command, comment, out)
