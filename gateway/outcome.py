"""What the pipeline (gateway/pipeline.py) decides for one request, and the bounds it decides under:
`Admit` (forward it) or `Answer` (send this instead), with the `RequestOutcome` and `DecidedBy`
that metrics and the access log read. Every entry point (proxy, middleware, check) reads these."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gateway.http.request import Request
from gateway.leases import Lease
from gateway.plan import RoutePlan
from gateway.protect import Slot
from gateway.responses import Headers
from gateway.settings import DEFAULTS
from gateway.settlement import Settlement


class RequestOutcome(StrEnum):
    """What became of one request: the `outcome` label of the metrics and the access log."""

    ADMITTED = "admitted"
    FAILED_OPEN = "failed_open"          # Redis unavailable, forwarded unlimited (failure_mode: open)
    REFUSED = "refused"                  # by a rule: Redis's decision, or one held in memory (DecidedBy)
    FAILED_CLOSED = "failed_closed"      # Redis unavailable, refused (failure_mode: closed)
    BAD_REQUEST = "bad_request"          # the request cannot be served as sent (4xx, 501)
    CLIENT_GONE = "client_gone"          # the client left before the decision
    NO_ROUTE = "no_route"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNKNOWN_KEY = "unknown_key"          # keys: an API key not registered, or none (401), never forwarded
    SHED = "shed"                        # protect: the upstream at its limit, its priority refused first (503)


class DecidedBy(StrEnum):
    """Who decided: the `decided_by` label of the metrics and the access log."""

    REDIS = "redis"    # the route's one script call
    MEMORY = "memory"  # a refusal Redis gave, held in this worker's memory (gateway/refusals.py)
    NONE = "none"      # no limit was asked: no rule applied, Redis unavailable, or an answer before any


@dataclass(slots=True)
class RequestBounds:
    """The per-request bounds the pipeline applies (from Settings)."""

    max_head_bytes: int = DEFAULTS.max_head_bytes
    body_timeout: float = DEFAULTS.body_timeout  # a body read for a `body` identity may pause this long


@dataclass(slots=True)
class Answer:
    """Send this instead of forwarding the request."""

    status: int
    headers: Headers
    body: bytes
    outcome: RequestOutcome
    route: str = ""                 # "" when no route matched
    rule: str = ""                  # the rule that refused, or whose identity was missing
    close: bool = False             # the framing is in doubt: end the connection after it
    request_id: bytes | None = None  # the client's X-Request-Id, when usable
    decided_by: DecidedBy = DecidedBy.NONE
    identity: str = ""              # the refusing rule's identity, shown (gateway.keys.shown): what key= takes
    consumer: str = ""              # the consumer of the request's API key (`keys:`), when it has one


@dataclass(slots=True)
class Admit:
    """Forward the request (after `delay_ms`, for a leaky_bucket), adding `headers` to its response."""

    request: Request
    plan: RoutePlan
    outcome: RequestOutcome          # ADMITTED, or FAILED_OPEN
    headers: Headers                 # rate-limit headers for the response
    delay_ms: int
    body_prefix: bytes | None        # body already read for a `body` identity, to be sent first
    more_body: bool                  # more of the body is still to come from the client
    decided_by: DecidedBy = DecidedBy.NONE
    settlement: Settlement | None = None  # what the answer may still charge or give back
    lease: Lease | None = None            # concurrency slots held until the request ends
    slot: Slot | None = None              # its place in a protected upstream's limit (gateway/protect.py)
    consumer: str = ""                    # the consumer of the request's API key (`keys:`), when it has one

    @property
    def route(self) -> str:
        return self.plan.route.name


GONE = Answer(499, [], b"", RequestOutcome.CLIENT_GONE)  # what a call cancelled before its answer is counted as
