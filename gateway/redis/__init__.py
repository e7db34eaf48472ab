"""Redis behind the limiter, through redis-py: where the decision script runs.

    errors.py      redis-py's exceptions -> gateway.errors, by type (the one edge)
    batch.py       the calls of one event-loop tick become one pipeline; one deadline per batch
    standalone.py  one server (redis://, rediss://, unix://) and a Sentinel-named primary
    cluster.py     Redis Cluster: one pipeline per node; MOVED, ASK, TRYAGAIN, CLUSTERDOWN, NOSCRIPT

`make_runner(settings)` builds the runner for `redis.mode`; gateway.limiter.Limiter is its only user.
Inside this package `import redis` is redis-py (imports are absolute).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from gateway.config import RedisSettings
from gateway.redis import connections
from gateway.redis.cluster import ClusterRunner
from gateway.redis.standalone import PipelineRunner, SentinelRunner

__all__ = ["CONNECT_TIMEOUT", "ClusterRunner", "PipelineRunner", "Runner", "SentinelRunner", "make_runner"]

Runner = PipelineRunner | SentinelRunner | ClusterRunner
CONNECT_TIMEOUT = 1.0  # seconds; also the breaker's probe budget (gateway.runtime) and the sentinels'


def _options(settings: RedisSettings) -> dict[str, Any]:
    """Connection options every mode shares.

    No retries inside redis-py: a decision is not idempotent (a reply lost after Redis ran the
    script must not run it twice), and the time budget is the batch's; a dead pooled connection is
    replaced when it is taken from the pool. No socket_timeout on reads: the batch's deadline
    bounds them (gateway/redis/batch.py), and a connect made on a decision's path too. Connecting
    has a bound of its own, CONNECT_TIMEOUT, for the breaker's probe: it is not the decision's
    budget, which a saturated worker's event loop can spend before it sees a loopback connect
    complete (a 20 ms bound there failed every probe under load)."""
    return {
        "socket_timeout": None,
        "socket_connect_timeout": max(settings.timeout, CONNECT_TIMEOUT),
        "retry": Retry(NoBackoff(), 0),
    }


def sentinel_addresses(url: str) -> tuple[list[tuple[str, int]], dict[str, object]]:
    """redis[s]://[user:password@]sentinel-a:26379,sentinel-b:26379[/db]: the sentinels, and the
    primary's connection options (credentials, db, TLS)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for item in hosts.split(","):
        host, has_port, port = item.strip().rpartition(":")
        sentinels.append((host, int(port)) if has_port else (port, 26379))
    options: dict[str, object] = {}
    if userinfo:
        user, has_password, password = userinfo.partition(":")
        if has_password:
            options["password"] = unquote(password)
            if user:
                options["username"] = unquote(user)
        else:
            options["password"] = unquote(user)
    db = parts.path.lstrip("/")
    if db:
        options["db"] = int(db)
    if parts.scheme == "rediss":
        options["ssl"] = True
    return sentinels, options


def make_runner(settings: RedisSettings) -> Runner:
    options = _options(settings)
    if settings.mode == "cluster":
        cluster = RedisCluster.from_url(settings.url, **options)
        # RedisCluster has no connection_class option (it picks Connection or SSLConnection): the
        # nodes it discovers take their options from its NodesManager, so ours goes there
        cluster.nodes_manager.connection_kwargs["connection_class"] = connections.for_url(settings.url)
        return ClusterRunner(cluster, settings.timeout)
    if settings.mode == "sentinel":
        addresses, primary = sentinel_addresses(settings.url)
        # the sentinels are asked off the decision path (on connect, and by the check): a socket
        # timeout there costs nothing
        sentinel_options = {**options, "socket_timeout": max(settings.timeout, CONNECT_TIMEOUT)}
        if primary.get("ssl"):
            sentinel_options["ssl"] = True
        primary["connection_class"] = (
            connections.SentinelTlsConnection if primary.pop("ssl", False) else connections.SentinelConnection)
        sentinel = Sentinel(addresses, sentinel_kwargs=sentinel_options, **options, **primary)
        return SentinelRunner(sentinel, settings.sentinel_master, settings.timeout)
    # what Redis.from_url does, but with our connection class: the URL's own (unix://, rediss://)
    # would win over a keyword argument
    url_options: dict[str, Any] = dict(parse_url(settings.url))
    url_options["connection_class"] = connections.for_url(settings.url)
    return PipelineRunner(Redis.from_pool(ConnectionPool(**{**options, **url_options})), settings.timeout)
