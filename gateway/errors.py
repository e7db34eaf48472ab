"""Every error the gateway raises on purpose, in one tree.

    GatewayError
    ├── ConfigError          routes.yaml is wrong; carries every problem found (file, line, key)
    ├── RedisUnavailable     no decision from Redis; `kind` labels gateway_redis_errors_total
    │   ├── RedisTimeout          no answer within redis.timeout (kind "timeout")
    │   ├── RedisConnectionFailed cannot connect, connection lost, no primary known (kind "connection")
    │   ├── RedisErrorReply       Redis answered with an error (kind "error_reply")
    │   └── BreakerOpen           not asked: the breaker is open after repeated failures (kind "breaker_open")
    ├── IdentityMissing      a rule's identity is absent from the request (on_missing: reject -> 400)
    ├── BadRequest           the request cannot be served as sent (ambiguous framing, bad path,
    │   │                    a repeated identity header, a bad cost header, ...) -> 400
    │   ├── HeadTooLarge          request line and headers over the bound -> 431
    │   └── NotImplementedRequest an Upgrade, CONNECT, a transfer-coding other than chunked -> 501
    └── UpstreamError        the upstream could not be reached or answered badly
        ├── UpstreamUnavailable   refused, reset or unreachable -> 502
        └── UpstreamTimeout       too slow -> 504

Third-party errors are converted to these at one edge each: redis-py's exceptions (by type, never
by message) in `gateway/redis/errors.py`, httpx's (which both upstream transports raise) in
`proxy.py`. Nothing above those edges catches a library's own exception type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class GatewayError(Exception):
    """Base of every error raised on purpose by the gateway."""


@dataclass(frozen=True)
class ConfigProblem:
    file: str
    line: int
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.key}: {self.message}"


class ConfigError(GatewayError):
    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class RedisUnavailable(GatewayError):
    """Redis gave no decision: the route's failure_mode applies."""

    kind: ClassVar[str] = "connection"  # the metrics label; each subclass names its own


class RedisTimeout(RedisUnavailable):
    kind = "timeout"


class RedisConnectionFailed(RedisUnavailable):
    kind = "connection"


class RedisErrorReply(RedisUnavailable):
    kind = "error_reply"


class BreakerOpen(RedisUnavailable):
    kind = "breaker_open"


class IdentityMissing(GatewayError):
    def __init__(self, rule: str, source: str) -> None:
        self.rule = rule
        self.source = source
        super().__init__(f"rule '{rule}' needs {source}, which the request does not carry")


class BadRequest(GatewayError):
    status = 400


class HeadTooLarge(BadRequest):
    status = 431


class NotImplementedRequest(BadRequest):
    status = 501


class UpstreamError(GatewayError):
    pass


class UpstreamUnavailable(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass
