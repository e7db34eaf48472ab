"""The Redis the gateway uses: the flag's or environment's URL, else routes.yaml's, else the embedded
redis-server the supervisor runs."""

from __future__ import annotations

from dataclasses import replace

from gateway.config import Config, RedisSettings
from gateway.settings import Settings


def redis_settings(settings: Settings, config: Config) -> RedisSettings:
    """The Redis the gateway uses: flag/env URL, else routes.yaml's, else the embedded server."""
    url = settings.redis_url or config.redis.url or settings.embedded_redis_url or ""
    mode = config.redis.mode if (settings.redis_url or config.redis.url) else "standalone"
    return replace(config.redis, url=url, mode=mode)


def needs_embedded_redis(settings: Settings, config: Config) -> bool:
    return not (settings.redis_url or config.redis.url)
