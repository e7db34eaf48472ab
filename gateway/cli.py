"""Command line: `gateway serve` and `gateway check`."""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from gateway.config import load_config
from gateway.errors import ConfigError
from gateway.rls.tls import tls_context
from gateway.settings import OPTIONS, Settings, from_env, from_process_env

if TYPE_CHECKING:
    from gateway.supervisor import WorkerMain


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway", description="A rate-limiting reverse proxy backed by Redis."
    )
    parser.add_argument("--version", action="version", version=f"gateway {gateway_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    for option in OPTIONS:
        if option.flag is not None and option.switch:
            serve.add_argument(option.flag, action="store_true", default=None, dest=option.field,
                               help=f"{option.help} (env {option.env}=1)")
        elif option.flag is not None:
            serve.add_argument(option.flag, type=option.kind, dest=option.field, metavar=option.shown_metavar,
                               help=f"{option.help} (env {option.env}; default {option.shown_default()})")
    check = sub.add_parser("check", help="validate a routes.yaml; exit 0, or 2 with every error")
    for option in OPTIONS:  # the ports that change what a file may hold, as serve takes them
        if option.flag is not None and option.field in ("check_port", "rls_port"):
            check.add_argument(option.flag, type=option.kind, dest=option.field, metavar=option.shown_metavar,
                               help=f"validate as serve would with it given (env {option.env})")
    check.add_argument("config", nargs="?", help="path to routes.yaml (default: as serve, GATEWAY_CONFIG "
                       "or routes.yaml)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check":
        try:
            env = from_process_env()
        except ValueError as exc:
            print(f"gateway: {exc}", file=sys.stderr)
            return 2
        return check(args.config or env.config_path, args.check_port is not None or env.check_port is not None)
    try:
        settings = resolve_settings(args, os.environ)
    except ValueError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def resolve_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """Defaults, then the environment, then flags."""
    flags = {option.field: getattr(args, option.field) for option in OPTIONS if option.flag is not None}
    settings = replace(from_env(env), **{k: v for k, v in flags.items() if v is not None})
    if settings.ephemeral and settings.data_dir is not None:
        raise ValueError("--ephemeral and --data-dir exclude each other: state in memory, or kept in DIR")
    return settings


def gateway_version() -> str:
    try:
        return version("ratelimit-gateway")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def check(path: str, check_port: bool = False) -> int:
    """Validate as `serve` reads the file: with the check port on (`check_port`, or a `check:`
    section in the file), every rule must be decidable there."""
    if not os.path.exists(path):
        print(f"gateway: no routes file at {os.path.abspath(path)}; "
              "pass its path (or set GATEWAY_CONFIG)", file=sys.stderr)
        return 2
    try:
        config = load_config(path, decision_only=check_port)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        print(f"{path}: {len(exc.problems)} error(s)", file=sys.stderr)
        return 2
    for warning in config.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rules = sum(len(r.limits) for r in config.limited_routes)
    counts = ", ".join(_counted(n, noun) for n, noun in
                       ((len(config.routes), "route"), (rules, "rule"), (len(config.upstreams), "upstream"),
                        *(((len(config.rls), "RLS domain"),) if config.rls else ())))
    print(f"{path}: ok ({counts})")
    return 0


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def serve(settings: Settings, worker: WorkerMain | None = None) -> int:
    """Run the gateway; `worker` replaces the worker's entry point (comparisons in tests and bench)."""
    from gateway.supervisor import Supervisor, configure_logging, file_stamp

    configure_logging(settings.log_level)
    if settings.workers < 1:
        print("gateway: --workers must be at least 1", file=sys.stderr)
        return 2
    ports = [settings.port, settings.admin_port,
             *(port for port in (settings.check_port, settings.rls_port) if port is not None)]
    if len(set(ports)) < len(ports):
        print("gateway: the proxy, admin, check and RLS ports must all differ", file=sys.stderr)
        return 2
    if (settings.rls_tls_cert is None) != (settings.rls_tls_key is None):
        print("gateway: --rls-tls-cert and --rls-tls-key go together", file=sys.stderr)
        return 2
    if settings.rls_tls_cert is not None:
        try:
            tls_context(settings.rls_tls_cert, settings.rls_tls_key or "")
        except (OSError, ssl.SSLError) as exc:
            print(f"gateway: the RLS port's certificate or key cannot be used: {exc}", file=sys.stderr)
            return 2
    if not os.path.exists(settings.config_path):
        print(f"gateway: no routes file at {os.path.abspath(settings.config_path)}; "
              "pass --config PATH (or set GATEWAY_CONFIG)", file=sys.stderr)
        return 2
    stamp = file_stamp(settings.config_path)  # before reading: a save during start-up is seen later
    try:
        config = load_config(settings.config_path, decision_only=settings.decision_only)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 2
    return Supervisor(settings, config, stamp, worker).run()


if __name__ == "__main__":
    sys.exit(main())
