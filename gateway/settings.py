"""All process settings in one typed object: defaults < environment < command-line flags.

`Settings` holds each default, once. `OPTIONS` says, per setting, its environment variable, its
`gateway serve` flag, its help and the Helm chart value that sets it; the argument parser
(gateway/cli.py), the environment reading below and the table in docs/configuration.md
(gateway/config/reference.py) are all made from it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gateway.urls import redis_url


@dataclass(frozen=True)
class Settings:
    config_path: str = "routes.yaml"
    host: str = "0.0.0.0"
    port: int = 8080
    admin_host: str = "127.0.0.1"          # admin (reset, reload, metrics): loopback unless asked
    admin_port: int = 9090
    workers: int = 1
    redis_url: str | None = None           # overrides routes.yaml's redis.url
    log_level: str = "info"
    drain_timeout: float = 10.0            # SIGTERM: how long in-flight requests may take
    watch_interval: float = 1.0            # how often the config file is checked for changes
    header_timeout: float = 10.0           # a client must send its request head within this
    send_timeout: float = 60.0             # ... and take something of its answer at least this often
    body_timeout: float = 30.0             # ... and never pause its body longer than this
    data_dir: str | None = None            # the embedded redis-server persists here; None: the default below
    ephemeral: bool = False                # the embedded redis-server keeps its state in memory only
    embedded_redis_url: str | None = None  # set by the supervisor when it runs redis-server
    max_head_bytes: int = 64 * 1024        # request line + headers; larger is a 431
    check_port: int | None = None          # the check endpoint (forward-auth), on `host`; off unless given
    rls_port: int | None = None            # Envoy's rate limit service (gRPC), on `host`; off unless given
    rls_tls_cert: str | None = None        # ... over TLS (ALPN h2) with this certificate chain and key
    rls_tls_key: str | None = None
    rls_idle_timeout: float = 10.0         # an RLS connection that opens no call for this long is closed
    rls_body_timeout: float = 10.0         # an RLS call whose body has not ended after this long is reset

    @property
    def decision_only(self) -> bool:
        """Is the check port on? Then every rule must be decidable without the upstream's answer."""
        return self.check_port is not None

    def embedded_data_dir(self) -> str | None:
        """Where the embedded Redis persists what it holds: --data-dir, else a per-user state
        directory keyed by the config file's path ($XDG_STATE_HOME, ~/.local/state); None with
        --ephemeral."""
        if self.ephemeral:
            return None
        if self.data_dir is not None:
            return self.data_dir
        config = os.path.abspath(self.config_path)
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        name = os.path.splitext(os.path.basename(config))[0] or "routes"
        return os.path.join(base, "ratelimit-gateway", f"{name}-{hashlib.sha256(config.encode()).hexdigest()[:12]}")

    @property
    def effective_admin_host(self) -> str:
        return self.admin_host


DEFAULTS = Settings()


def boolean(text: str) -> bool:
    """A switch's value in the environment: 1, true, yes, on, or 0, false, no, off."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false (1 or 0)")


@dataclass(frozen=True)
class Option:
    """One setting as an operator meets it."""

    field: str
    env: str
    kind: type[int] | type[float] | type[str] | Callable[[str], bool] | Callable[[str], str]  # boolean: a switch
    help: str
    flag: str | None = None
    chart: str | None = None  # the chart's value (helm/gateway/values.yaml) that sets it
    unset: str = "none"       # what a default of None means, in words
    metavar: str = ""

    @property
    def switch(self) -> bool:
        return self.kind is boolean

    @property
    def shown_metavar(self) -> str:
        names: dict[object, str] = {int: "N", float: "SECONDS"}
        return self.metavar or names.get(self.kind, "VALUE")

    @property
    def default(self) -> object:
        return getattr(DEFAULTS, self.field)

    def shown_default(self) -> str:
        value = self.default
        if value is None:
            return self.unset
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float) and value.is_integer():
            return f"{int(value)}"
        return str(value)


OPTIONS: tuple[Option, ...] = (
    Option("config_path", "GATEWAY_CONFIG", str, "routes.yaml to serve", "--config", metavar="PATH"),
    Option("host", "GATEWAY_HOST", str, "address of the proxy, check and RLS ports", "--host", metavar="ADDRESS"),
    Option("port", "GATEWAY_PORT", int, "proxy port", "--port", chart="containerPorts.proxy"),
    Option("admin_host", "GATEWAY_ADMIN_HOST", str,
           "admin address: loopback keeps reset and reload on this machine", "--admin-host",
           metavar="ADDRESS"),
    Option("admin_port", "GATEWAY_ADMIN_PORT", int, "admin port", "--admin-port", chart="containerPorts.admin"),
    Option("workers", "GATEWAY_WORKERS", int, "worker processes", "--workers", chart="workers"),
    Option("check_port", "GATEWAY_CHECK_PORT", int,
           "the check endpoint: forward-auth for nginx, Envoy, Traefik and Caddy", "--check-port",
           chart="check.containerPort", unset="off"),
    Option("rls_port", "GATEWAY_RLS_PORT", int, "Envoy's rate limit service (gRPC, envoy.service.ratelimit.v3) "
           "for Envoy, Istio, Contour and Gloo", "--rls-port", chart="rls.containerPort", unset="off"),
    Option("rls_tls_cert", "GATEWAY_RLS_TLS_CERT", str, "serve the rate limit service over TLS (HTTP/2 by ALPN) "
           "with this PEM certificate chain, with --rls-tls-key", "--rls-tls-cert", chart="rls.tls.secretName",
           unset="plain HTTP/2", metavar="PEM"),
    Option("rls_tls_key", "GATEWAY_RLS_TLS_KEY", str, "the PEM private key of --rls-tls-cert", "--rls-tls-key",
           chart="rls.tls.secretName", metavar="PEM"),
    Option("rls_idle_timeout", "GATEWAY_RLS_IDLE_TIMEOUT", float,
           "seconds an RLS connection may go without a call before it is closed (PING and other frames do not count)"),
    Option("rls_body_timeout", "GATEWAY_RLS_BODY_TIMEOUT", float,
           "seconds an RLS call's body may take to end before its stream is reset (CANCEL)"),
    Option("redis_url", "GATEWAY_REDIS_URL", redis_url, "Redis URL; overrides routes.yaml's redis.url", "--redis-url",
           chart="redis.url", unset="routes.yaml's, else the embedded Redis", metavar="URL"),
    Option("data_dir", "GATEWAY_DATA_DIR", str, "where the embedded Redis persists its state", "--data-dir",
           unset="a per-user state directory keyed by the config file's path ($XDG_STATE_HOME/ratelimit-gateway/...); "
           "--ephemeral: in memory, gone on exit", metavar="DIR"),
    Option("ephemeral", "GATEWAY_EPHEMERAL", boolean, "the embedded Redis keeps its state in memory only, gone on "
           "exit (not with --data-dir)", "--ephemeral"),
    Option("log_level", "GATEWAY_LOG_LEVEL", str, "debug, info, warning or error", chart="logLevel"),
    Option("drain_timeout", "GATEWAY_DRAIN_TIMEOUT", float,
           "seconds in-flight requests may take after SIGTERM", chart="drainTimeoutSeconds"),
    Option("watch_interval", "GATEWAY_WATCH_INTERVAL", float,
           "seconds between checks of routes.yaml (and the RLS files) for changes; 0: never"),
    Option("header_timeout", "GATEWAY_HEADER_TIMEOUT", float, "seconds a client has to send its request head"),
    Option("body_timeout", "GATEWAY_BODY_TIMEOUT", float, "seconds a client's request body may pause"),
    Option("send_timeout", "GATEWAY_SEND_TIMEOUT", float,
           "seconds a client may take nothing of its answer before it is cut"),
    Option("max_head_bytes", "GATEWAY_MAX_HEAD_BYTES", int, "bytes of request line and headers; past it a 431"),
)

ENV_KEYS = {option.env: (option.field, option.kind) for option in OPTIONS}


def from_env(env: Mapping[str, str], base: Settings | None = None) -> Settings:
    settings = base or Settings()
    values: dict[str, object] = {}
    for name, (field_name, kind) in ENV_KEYS.items():
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            values[field_name] = kind(raw)
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from exc
    return replace(settings, **values)  # type: ignore[arg-type]


# What a worker learns from its supervisor, and what other tools name by their own variables: read
# here too, so that every variable the gateway reads is in this file.
METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multi-process directory
SUPERVISED = "GATEWAY_SUPERVISED"  # set for the workers of `gateway serve`
REDIS_SERVER = "GATEWAY_REDIS_SERVER"  # the embedded Redis's binary, when not the bundled one


def metrics_dir() -> str | None:
    """The directory the workers' metrics are shared in; None: one process, in memory."""
    return os.environ.get(METRICS_DIR) or None


def supervised() -> bool:
    """This process is a worker of `gateway serve`'s supervisor."""
    return os.environ.get(SUPERVISED) == "1"


def announce_supervision(metrics_directory: str) -> None:
    """The supervisor's, before it starts workers: they inherit both."""
    os.environ[METRICS_DIR] = metrics_directory
    os.environ[SUPERVISED] = "1"


def redis_server_override() -> str | None:
    return os.environ.get(REDIS_SERVER) or None


def opentelemetry(name: str, default: str = "") -> str:
    """One of the OpenTelemetry SDK's own variables (OTEL_SERVICE_NAME, OTEL_TRACES_EXPORTER, ...)."""
    if not name.startswith("OTEL_"):
        raise ValueError(f"{name} is not an OpenTelemetry variable")
    return os.environ.get(name, default)


def from_process_env(base: Settings | None = None) -> Settings:
    """`from_env` of this process's environment."""
    return from_env(os.environ, base)
