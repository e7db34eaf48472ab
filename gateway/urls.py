"""URLs the gateway connects to, checked when they are read: Python's urllib takes a port past
65535 for no port at all, and redis-py and httpx fail on it only at the first connection (a
worker that restarted for ever, a request that never got its answer)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

REDIS_SCHEMES = re.compile(r"^(redis|rediss|unix)://")
REDIS_SCHEMES_SAID = "must start with redis://, rediss:// or unix://"


def reachable(url: str) -> str:
    """`url`, if the port it names (if any) is one a client can connect to; else ValueError."""
    try:
        port = urlsplit(url).port
    except ValueError as exc:
        raise ValueError(f"{url!r} names no port a client can connect to ({exc})") from None
    if port == 0:
        raise ValueError(f"{url!r} names port 0, which no client can connect to")
    return url


def redis_url(url: str) -> str:
    """A Redis URL as --redis-url and GATEWAY_REDIS_URL take it; ValueError when it cannot be one."""
    if not REDIS_SCHEMES.match(url):
        raise ValueError(f"{url!r} {REDIS_SCHEMES_SAID}")
    return reachable(url)
