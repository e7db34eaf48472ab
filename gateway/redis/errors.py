"""The one edge where redis-py's exceptions become the gateway's (gateway.errors), by type only.

    redis.exceptions.TimeoutError, asyncio's TimeoutError   -> RedisTimeout
    redis.exceptions.ClusterDownError                        -> RedisConnectionFailed
    redis.exceptions.ResponseError (any other error reply)   -> RedisErrorReply
    any other RedisError (ConnectionError, MasterNotFound,
      ClusterError, ...), RedisClusterException, OSError     -> RedisConnectionFailed

Redirections (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) and NOSCRIPT are answered by the runners before
they get here; one that is still left when the time budget ends is an error reply like any other.
"""

from __future__ import annotations

from redis import exceptions as rx

from gateway.errors import RedisConnectionFailed, RedisErrorReply, RedisTimeout, RedisUnavailable

# What `convert` takes: everything else (a bug) goes up as it is
REDIS_FAILURES = (rx.RedisError, rx.RedisClusterException, OSError, TimeoutError)


def convert(exc: BaseException) -> RedisUnavailable:
    if isinstance(exc, RedisUnavailable):
        return exc
    if isinstance(exc, (rx.TimeoutError, TimeoutError)):  # redis-py's is not a builtin TimeoutError
        return RedisTimeout(f"Redis did not answer in time ({exc.__class__.__name__}: {exc})")
    if isinstance(exc, rx.ClusterDownError):
        return RedisConnectionFailed(f"Redis Cluster is down: {exc}")
    if isinstance(exc, rx.ResponseError):
        return RedisErrorReply(f"Redis answered with an error: {exc}")
    return RedisConnectionFailed(f"Redis connection failed ({exc.__class__.__name__}: {exc})")
