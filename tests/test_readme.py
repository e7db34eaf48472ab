"""Every command of the README's two `make run` walk-throughs, run as written against the repository's
routes.yaml and example backend, with what its comment says checked: a status the comment names,
the statuses a loop prints, a stock's "N left". Only the ports are changed (the test's own)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_for_port

ROOT = Path(__file__).resolve().parents[1]
STATUS = re.compile(r"@status=(\d{3})")
# curl as the README runs it, telling the test each answer's status (a loop's own -w comes after and wins)
CURL = "curl() { command curl -sS -w '\\n@status=%{http_code}\\n' \"$@\"; }\n"


def readme_blocks() -> list[list[tuple[str, str]]]:
    """The README's ```sh blocks that talk to the running gateway: (command, its comment) pairs; a
    comment alone on a line continues the command above's."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if "localhost:8080" not in block and "$ADMIN" not in block:
            continue
        commands: list[tuple[str, str]] = []
        for line in block.splitlines():
            command, _, comment = line.partition("  # ") if not line.lstrip().startswith("#") else ("", "", line)
            if command.strip():
                commands.append((command.strip(), comment.strip()))
            elif commands and line.startswith(" "):
                commands[-1] = (commands[-1][0], commands[-1][1] + " " + comment.strip().lstrip("# "))
        blocks.append(commands)
    return blocks


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess) -> Iterator[GatewayProcess]:
    """`make run`'s three parts: the example backend, the gateway on routes.yaml, its Redis."""
    port = free_port()
    backend = started([sys.executable, "-m", "gateway.example_backend", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = GatewayProcess((ROOT / "routes.yaml").read_text(), tmp_path_factory.mktemp("readme"),
                             redis_url=redis_proc.url, env={"SHOP_URL": f"http://127.0.0.1:{port}"})
    try:
        wait_for_port(port, backend)
        gateway.start()
        yield gateway
    finally:
        gateway.stop()
        backend.terminate()
        backend.wait(10)


def run(gateway: GatewayProcess, command: str) -> str:
    command = (command.replace("localhost:8080", f"127.0.0.1:{gateway.port}")
               .replace("localhost:9090", f"127.0.0.1:{gateway.admin_port}")
               .replace("ADMIN=http://127.0.0.1:9090", f"ADMIN=http://127.0.0.1:{gateway.admin_port}"))
    done = subprocess.run(["bash", "-c", CURL + command], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "ADMIN": f"http://127.0.0.1:{gateway.admin_port}",
                               "ADMIN_TOKEN": ""})
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def expected_statuses(comment: str) -> list[str]:
    """The statuses a comment names before its first word: "200", "409: duplicate", "... 200 429 429"."""
    head = re.split(r"[A-Za-z:,]", comment.lstrip("#. "), maxsplit=1)[0]
    return [n for n in head.replace(".", " ").split() if re.fullmatch(r"[1-5]\d\d", n)]


def test_the_readme_commands_do_what_their_comments_say(running: GatewayProcess) -> None:
    blocks = readme_blocks()
    assert len(blocks) == 2 and sum(len(b) for b in blocks) >= 18  # the walk-through and the overrides
    for commands in blocks:
        for command, comment in commands:
            if command.startswith("ADMIN="):
                assert command.count(";") == 1
                continue  # variables, set for every command here
            out = run(running, command)
            said = STATUS.findall(out)
            wanted = expected_statuses(comment)
            if command.startswith("for "):
                printed = out.split("\n@status=")[0].split() if "@status" in out else out.split()
                assert printed[-len(wanted):] == wanted, (command, out)
                continue
            assert said, (command, out)
            if wanted:
                assert said[-1] == wanted[0], (command, comment, out)
            else:
                assert said[-1].startswith("2"), (command, out)  # a command whose comment names no status
            if (left := re.match(r"(\d+) left", comment)) is not None:
                body = json.loads(out.split("\n@status=")[0])
                assert body["remaining"] == int(left.group(1)), (command, body)
