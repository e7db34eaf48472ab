"""The gateway with the libraries' own HTTP/1.1 implementations behind its seams, for comparison
only (tests/conformance and bench/run.py): uvicorn's httptools protocol in place of
gateway/http/server.py, httpx's AsyncHTTPTransport in place of gateway/http/transport.py.

    python -m tests.support.comparison_gateway --http uvicorn --transport httpx serve --config ...

No product setting selects them: both fail parts of tests/conformance (docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence

import uvicorn

from gateway import cli
from gateway.app import compose
from gateway.config import Config
from gateway.settings import Settings
from gateway.supervisor import WorkerMain, configure_logging, run_worker, uvicorn_options
from gateway.supervisor import server_config as gateway_server_config


def _worker(settings: Settings, sockets: list[socket.socket], config: Config, http: str, transport: str) -> None:
    configure_logging(settings.log_level)
    composed = compose(settings, config, transport=transport)
    if http == "uvicorn":
        server_config = uvicorn.Config(composed.app, http="httptools", **uvicorn_options(settings))
    else:
        server_config = gateway_server_config(settings, composed)
    run_worker(settings, sockets, composed, server_config)


# module-level, so that the spawned worker process can import them
def gateway_lean(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _worker(settings, sockets, config, "gateway", "lean")


def gateway_httpx(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _worker(settings, sockets, config, "gateway", "httpx")


def uvicorn_lean(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _worker(settings, sockets, config, "uvicorn", "lean")


def uvicorn_httpx(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _worker(settings, sockets, config, "uvicorn", "httpx")


WORKERS: dict[tuple[str, str], WorkerMain] = {
    ("gateway", "lean"): gateway_lean, ("gateway", "httpx"): gateway_httpx,
    ("uvicorn", "lean"): uvicorn_lean, ("uvicorn", "httpx"): uvicorn_httpx,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="comparison_gateway")
    parser.add_argument("--http", choices=("gateway", "uvicorn"), default="gateway")
    parser.add_argument("--transport", choices=("lean", "httpx"), default="lean")
    ours, rest = parser.parse_known_args(argv)
    args = cli.parse_args(rest)
    assert args.command == "serve", "only `serve` has workers to compare"
    settings = cli.resolve_settings(args, os.environ)
    return cli.serve(settings, WORKERS[ours.http, ours.transport])


if __name__ == "__main__":
    sys.exit(main())
