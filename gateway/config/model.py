"""The validated configuration: frozen objects, their defaults read from the field table."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config.fields import BUCKET_ALGORITHMS, Algorithm, Place, default
from gateway.errors import ConfigProblem

P = Place


@dataclass(frozen=True)
class RedisSettings:
    url: str = default(P.REDIS, "url")
    mode: str = default(P.REDIS, "mode")
    timeout: float = default(P.REDIS, "timeout")
    key_prefix: str = default(P.REDIS, "key_prefix")
    sentinel_master: str = default(P.REDIS, "sentinel_master")


@dataclass(frozen=True)
class UpstreamTls:
    ca: str | None = default(P.TLS, "ca")
    cert: str | None = default(P.TLS, "cert")
    key: str | None = default(P.TLS, "key")
    verify: bool = default(P.TLS, "verify")


@dataclass(frozen=True)
class Upstream:
    name: str
    url: str
    timeout: float = default(P.UPSTREAM, "timeout")
    connect_timeout: float = default(P.UPSTREAM, "connect_timeout")
    max_connections: int = default(P.UPSTREAM, "max_connections")
    http2: bool = default(P.UPSTREAM, "http2")
    tls: UpstreamTls | None = None
    protect: Protect | None = None  # an adaptive in-flight limit for every route to it (gateway/protect.py)


@dataclass(frozen=True)
class Source:
    kind: str
    name: str = ""
    type: str | None = None  # "int" or "float": read as the upstream reads that type (gateway/typed_values.py)
    # its values are credentials: shown only as their fingerprint (gateway/keys.py), never as they came
    secret: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        named = f"{self.kind}:{self.name}" if self.name else self.kind
        return f"{named}:{self.type}" if self.type else named


@dataclass(frozen=True)
class Rule:
    """One rule. `algorithm` may be given as its name; it is always an Algorithm once built."""

    name: str
    by: tuple[Source, ...]
    algorithm: str
    limit: int = default(P.RULE, "limit")          # windows and quota
    window: float = default(P.RULE, "window")      # seconds; windows; quota period (0 = never refills)
    rate: float = default(P.RULE, "rate")          # per second; buckets
    burst: int = default(P.RULE, "burst")          # buckets
    cost: int = default(P.RULE, "cost")
    cost_header: str | None = None                 # the client declares the cost (header:NAME)
    status: int = default(P.RULE, "status")
    shadow: bool = default(P.RULE, "shadow")
    on_missing: str = default(P.RULE, "on_missing")
    cost_response_header: str | None = None        # the upstream declares the cost (response_header:NAME)
    count_on: frozenset[int] = frozenset()         # charged after the answer, only for these statuses
    refund_on: frozenset[int] = frozenset()        # units charged at admission given back on these
    lease: float = default(P.RULE, "lease")        # seconds; concurrency: a dead holder's slot is free after it
    reserve_field: tuple[str, ...] | None = None   # a token budget: charged at admission from this request JSON path
    settle_field: tuple[str, ...] | None = None    # ... settled to this path of the answer's JSON or SSE
    reserve_max: int | None = None                 # ... refused past this (None: the rule's capacity)
    max_overrides: int = default(P.RULE, "max_overrides")  # per-identity overrides it may hold
    shared: bool = False                           # a rule of `shared:`: one counter in every route using it
    calendar_period: str | None = None             # "day", "week", "month": window/period by the calendar
    calendar: str = default(P.RULE, "calendar")    # ... of this IANA zone (gateway/calendars.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))

    @property
    def charged_after(self) -> bool:
        """Checked at admission, charged when the answer comes (count_on, cost: response_header)."""
        return bool(self.count_on) or self.cost_response_header is not None

    @property
    def readable_identity(self) -> bool:
        """Whether this rule's identity may be kept as it came (gateway/keys.py): only the client's
        address, the path, the method and the API key's consumer, which an access log shows anyway."""
        return all(source.kind in ("ip", "path", "method", "consumer") for source in self.by)

    @property
    def unseen_by_a_check(self) -> tuple[str, ...]:
        """The keys of this rule that need what a decision service never sees: the upstream's
        answer, or the request's body. Empty: a check port can decide it."""
        keys = []
        if self.count_on:
            keys.append("count_on")
        if self.refund_on:
            keys.append("refund_on")
        if self.cost_response_header is not None or self.settle_field is not None:
            keys.append("cost")
        if self.algorithm == Algorithm.CONCURRENCY:
            keys.append("algorithm")
        if any(source.kind == "body" for source in self.by):
            keys.append("by")
        return tuple(keys)

    @property
    def settles(self) -> bool:
        """Whether the answer may change what this rule counts."""
        return self.charged_after or bool(self.refund_on) or self.settle_field is not None

    @property
    def capacity(self) -> int:
        """The largest cost this rule can ever admit at once."""
        if self.algorithm == Algorithm.LEAKY_BUCKET:
            return self.burst + 1
        return self.quota_size

    @property
    def quota_size(self) -> int:
        return self.burst if self.algorithm in BUCKET_ALGORITHMS else self.limit

    @property
    def policy_window(self) -> float:
        """Seconds the quota is measured over, for RateLimit-Policy (0 = no window)."""
        if self.algorithm == Algorithm.CONCURRENCY:
            return 0.0  # slots in flight, not a rate
        if self.algorithm in BUCKET_ALGORITHMS:
            return self.burst / self.rate
        return self.window


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Conditions:
    """Who is asking, beyond path, methods and host (`match: headers, jwt, client`): every one given
    must hold, or the route is passed over for the next."""

    headers: tuple[tuple[bytes, frozenset[bytes] | None], ...] = ()  # name, its values (None: present)
    jwt: tuple[tuple[str, frozenset[str]], ...] = ()                 # claim, its values
    client: tuple[Network, ...] = ()
    plans: frozenset[str] = frozenset()  # the plan of the request's API key is one of these (`keys:`)

    def __bool__(self) -> bool:
        return bool(self.headers or self.jwt or self.client or self.plans)


@dataclass(frozen=True)
class Priority:
    """One class of `protect.priorities`: the requests it takes, and how much of the limit they may fill."""

    name: str
    share: float                      # of the in-flight limit, 0 < share <= 1
    when: Conditions = Conditions()
    methods: frozenset[str] | None = None
    queue_size: int = 0               # requests that may wait for a place; 0: refused at once
    queue_timeout: float = 0.0        # seconds one may wait

    def __post_init__(self) -> None:
        assert 0 < self.share <= 1, self.share


@dataclass(frozen=True)
class Protect:
    """`protect:` the answer time an upstream is kept to, and who is refused first when it is not."""

    priorities: tuple[Priority, ...]  # first match wins; the last takes every request left
    target: float | None = default(P.LATENCY, "target")          # seconds; None: twice the unloaded time
    percentile: int = default(P.LATENCY, "percentile")
    min_limit: int = default(P.PROTECT, "min_limit")
    max_limit: int = default(P.PROTECT, "max_limit")
    scope: str = default(P.PROTECT, "scope")          # worker: each worker its own limit; fleet: one in Redis
    lease: float = default(P.PROTECT, "lease")        # seconds (fleet): how long a dead gateway's slots outlive it


@dataclass(frozen=True)
class KeysSettings:
    """`keys:` where a request's API key is read, what an unknown one gets, the plans there are."""

    source: Source
    unknown: str
    plans: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    methods: frozenset[str] | None
    host: str | None
    upstream: Upstream | None  # None only where the middleware guards an app in-process
    limits: tuple[Rule, ...]
    failure_mode: str = default(P.ROUTE, "failure_mode")
    headers: str = default(P.ROUTE, "headers")
    method_override: str = default(P.ROUTE, "method_override")  # "ignore": the upstream honours no override
    shards: int = default(P.ROUTE, "shards")  # hash tags the route's keys spread over (Redis Cluster)
    websocket: bool = default(P.ROUTE, "websocket")  # a WebSocket handshake is forwarded and tunneled
    websocket_idle_timeout: float = default(P.ROUTE, "websocket_idle_timeout")
    when: Conditions = Conditions()            # match: headers, jwt, client
    respond: str | None = None                 # "usage": answered by the gateway (gateway/caller_usage.py)
    usage_of: tuple[str, ...] = ()             # ... with these routes' rules (empty: every limited route)
    path_case: str = default(P.MATCH, "path_case")  # "insensitive": the template matches in any case
    protect: Protect | None = None             # its own adaptive in-flight limit, in place of its upstream's

    @property
    def split(self) -> tuple[bool, ...]:
        """Per rule: whether it holds its limit split over the shards (see `keeps_full_limit`)."""
        if self.shards == 1 or not self.limits:
            return tuple(False for _ in self.limits)
        first = self.limits[0]
        return tuple(not keeps_full_limit(first, rule) for rule in self.limits)


def keeps_full_limit(first: Rule, rule: Rule) -> bool:
    """Whether every request of one of `rule`'s identities lands in one shard of a route whose
    shard is chosen by `first`'s identity: its sources include all of `first`'s, so its identity
    fixes `first`'s. Not when it falls back to the client address while `first` does not (its key
    would then be shared by requests that `first` sends to different shards)."""
    mine, theirs = set(rule.by), set(first.by)
    if not theirs or not mine >= theirs:
        return False
    return mine == theirs or rule.on_missing != "ip"


def shard_share(total: int, shards: int, shard: int) -> int:
    """Shard `shard`'s part of `total` split over `shards`: floor division, the remainder one each
    to the first shards, so the shares add up to exactly `total`."""
    base, extra = divmod(total, shards)
    return base + (1 if shard < extra else 0)


@dataclass(frozen=True)
class JwtSettings:
    algorithms: tuple[str, ...] = default(P.JWT, "algorithms")
    secret: str | None = None
    public_key: str | None = None
    audience: str | None = None
    issuer: str | None = None
    header: str = default(P.JWT, "header")
    leeway: float = default(P.JWT, "leeway")


@dataclass(frozen=True)
class RlsDescriptor:
    """One entry of an Envoy rate limit service domain's descriptor tree (gateway/rls/service.py)."""

    key: str
    value: str = ""                 # "": any value, each its own count; "...*": values starting so
    rule: int | None = None         # the domain route's rule a descriptor ending here counts by
    unlimited: bool = False         # a descriptor ending here is OK, counted by nothing
    replaces: tuple[str, ...] = ()  # rule names not counted when a request matches this one too
    descriptors: tuple[RlsDescriptor, ...] = ()


@dataclass(frozen=True)
class RlsDomain:
    """A domain of Envoy's rate limit service: its rules are those of `route`, a route of its own
    (named `rls.<domain>`) that no HTTP request matches; its keys, overrides, metrics and the admin
    port's views are a route's."""

    name: str
    route: Route
    descriptors: tuple[RlsDescriptor, ...]
    names: tuple[str, ...] = ()     # per rule of `route`: the name RateLimit.name carries (a file's `name`)


LOCAL_REFUSALS_MAX: int = default(P.LOCAL_REFUSALS, "max_entries")  # refusals each worker keeps (refusals.py)
LOCAL_REFUSALS_HOLD: float = default(P.LOCAL_REFUSALS, "max_hold")  # seconds before Redis is asked again


@dataclass(frozen=True)
class Config:
    source: str
    redis: RedisSettings
    trusted_proxies: tuple[Network, ...]
    upstreams: Mapping[str, Upstream]
    routes: tuple[Route, ...]
    jwt: JwtSettings = field(default_factory=JwtSettings)
    admin_token: str | None = None
    body_digest_max_bytes: int = default(P.IDENTITY, "body_max_bytes")
    identity_max_bytes: int = default(P.IDENTITY, "max_length")
    access_log: bool = default(P.TOP, "access_log")
    local_refusals_max: int = LOCAL_REFUSALS_MAX  # 0: every request asks Redis
    local_refusals_hold: float = LOCAL_REFUSALS_HOLD  # how stale an admin reset may be elsewhere
    check_deny_status: int | None = None  # the check endpoint's status for every refusal (nginx: 403)
    check_path_prefix: str = default(P.CHECK, "path_prefix")
    check_convention: str = default(P.CHECK, "convention")
    rls: tuple[RlsDomain, ...] = ()  # Envoy's rate limit service (gateway/rls/)
    keys: KeysSettings | None = None  # API keys and plans at runtime (gateway/api_keys.py)
    rls_files: tuple[str, ...] = ()  # the envoyproxy/ratelimit files it read (watched as routes.yaml is)
    warnings: tuple[ConfigProblem, ...] = ()  # accepted, but likely not what was meant (`gateway check` prints them)

    @property
    def limited_routes(self) -> tuple[Route, ...]:
        """Every route with rules: the HTTP routes and the rate limit service's domains."""
        return self.routes + tuple(domain.route for domain in self.rls)

