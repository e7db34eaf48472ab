"""All process settings in one typed object: defaults < environment < command-line flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from gateway.config import Config, RedisSettings


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
    data_dir: str | None = None            # the embedded redis-server persists here; None: memory only
    embedded_redis_url: str | None = None  # set by the supervisor when it runs redis-server
    max_head_bytes: int = 64 * 1024        # request line + headers; larger is a 431
    check_port: int | None = None          # the check endpoint (forward-auth), on `host`; off unless given
    rls_port: int | None = None            # Envoy's rate limit service (gRPC), on `host`; off unless given
    rls_tls_cert: str | None = None        # ... over TLS (ALPN h2) with this certificate chain and key
    rls_tls_key: str | None = None

    @property
    def decision_only(self) -> bool:
        """Is the check port on? Then every rule must be decidable without the upstream's answer."""
        return self.check_port is not None

    @property
    def effective_admin_host(self) -> str:
        return self.admin_host


ENV_KEYS = {
    "GATEWAY_CONFIG": ("config_path", str),
    "GATEWAY_PORT": ("port", int),
    "GATEWAY_ADMIN_PORT": ("admin_port", int),
    "GATEWAY_WORKERS": ("workers", int),
    "GATEWAY_REDIS_URL": ("redis_url", str),
    "GATEWAY_LOG_LEVEL": ("log_level", str),
    "GATEWAY_HOST": ("host", str),
    "GATEWAY_ADMIN_HOST": ("admin_host", str),
    "GATEWAY_DATA_DIR": ("data_dir", str),
    "GATEWAY_DRAIN_TIMEOUT": ("drain_timeout", float),
    "GATEWAY_HEADER_TIMEOUT": ("header_timeout", float),
    "GATEWAY_SEND_TIMEOUT": ("send_timeout", float),
    "GATEWAY_BODY_TIMEOUT": ("body_timeout", float),
    "GATEWAY_WATCH_INTERVAL": ("watch_interval", float),
    "GATEWAY_MAX_HEAD_BYTES": ("max_head_bytes", int),
    "GATEWAY_CHECK_PORT": ("check_port", int),
    "GATEWAY_RLS_PORT": ("rls_port", int),
    "GATEWAY_RLS_TLS_CERT": ("rls_tls_cert", str),
    "GATEWAY_RLS_TLS_KEY": ("rls_tls_key", str),
}


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


def redis_settings(settings: Settings, config: Config) -> RedisSettings:
    """The Redis the gateway uses: flag/env URL, else routes.yaml's, else the embedded server."""
    url = settings.redis_url or config.redis.url or settings.embedded_redis_url or ""
    mode = config.redis.mode if (settings.redis_url or config.redis.url) else "standalone"
    return replace(config.redis, url=url, mode=mode)


def needs_embedded_redis(settings: Settings, config: Config) -> bool:
    return not (settings.redis_url or config.redis.url)

