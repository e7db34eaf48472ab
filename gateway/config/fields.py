"""Every key of routes.yaml, declared once: where it may appear, what it holds, its default, and its
line in the docs.

The loader's allow-lists and defaults, the JSON schema (gateway/routes.schema.json) and the reference
table (docs/configuration.md) are all read from FIELDS. Adding a key is one entry here, the code that
uses it, and an example; `python -m gateway.config.schema` and `python -m gateway.config.reference`
regenerate the other two (tests/test_schema.py fails while they are stale).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.config.kinds import (
    Boolean,
    Choice,
    Conditions,
    Cost,
    Duration,
    HostName,
    Integer,
    Kind,
    ListOf,
    Name,
    Named,
    Network,
    Rate,
    Section,
    Source,
    Status,
    Template,
    Text,
    Url,
    Window,
    Zone,
)
from gateway.urls import REDIS_SCHEMES, REDIS_SCHEMES_SAID


class Place(StrEnum):
    """Where a key may appear: the top level of the file, or one kind of mapping in it."""

    TOP = "top"
    REDIS = "redis"
    DEFAULTS = "defaults"
    JWT = "jwt"
    ADMIN = "admin"
    IDENTITY = "identity"
    LOCAL_REFUSALS = "local_refusals"
    CHECK = "check"
    UPSTREAM = "upstream"
    TLS = "tls"
    ROUTE = "route"
    MATCH = "match"
    RULE = "rule"
    USE = "use"
    KEYS = "keys"
    RLS = "rls"
    RLS_DOMAIN = "rls_domain"
    RLS_DESCRIPTOR = "rls_descriptor"
    PROTECT = "protect"
    LATENCY = "latency"
    PRIORITY = "priority"
    PRIORITY_MATCH = "priority_match"
    QUEUE = "queue"


PLACES: dict[Place, str] = {
    Place.TOP: "The top level of routes.yaml.",
    Place.REDIS: "`redis:` where limits are kept. No url (or an empty one): the gateway starts its own redis-server.",
    Place.DEFAULTS: "`defaults:` policy for every route; a route may set the same keys again.",
    Place.JWT: "`jwt:` how `jwt:CLAIM` identities are verified; an unverified token is no identity.",
    Place.ADMIN: "`admin:` the admin port.",
    Place.IDENTITY: "`identity:` bounds on identities.",
    Place.LOCAL_REFUSALS: "`local_refusals:` refusals each worker answers from memory until Redis would stop "
                          "refusing (docs/algorithms.md).",
    Place.CHECK: "`check:` the check endpoint (`--check-port`): forward-auth for nginx `auth_request`, "
                 "Envoy `ext_authz`, Traefik `ForwardAuth` and Caddy `forward_auth` (docs/behind-a-proxy.md).",
    Place.UPSTREAM: "`upstreams: {NAME: ...}` one upstream the routes forward to.",
    Place.TLS: "`upstreams.NAME.tls:` TLS to an https:// upstream.",
    Place.ROUTE: "`routes: [...]` one route; routes are tried in file order and the first match wins.",
    Place.MATCH: "`routes[].match:` which requests the route takes.",
    Place.RLS: "`rls:` Envoy's rate limit service (`--rls-port`): envoyproxy/ratelimit's own files, and domains "
               "in the gateway's own form (docs/envoy-rls.md).",
    Place.RLS_DOMAIN: "`rls.domains: {DOMAIN: ...}` one domain: the descriptors Envoy sends with that domain.",
    Place.RLS_DESCRIPTOR: "`rls.domains.DOMAIN.descriptors: [...]` one descriptor entry; the most specific "
                          "match of a request's descriptor wins, as in envoyproxy/ratelimit.",
    Place.PROTECT: "`upstreams.NAME.protect:` or `routes[].protect:` an adaptive limit on the requests in flight "
                   "to the upstream, per worker or (scope: fleet) one for every gateway, which grows while its "
                   "answer time stays near the unloaded one and shrinks when it rises; at the limit the lowest "
                   "priority is refused first (503, Retry-After). A route's replaces its upstream's for its "
                   "requests (docs/algorithms.md).",
    Place.LATENCY: "`protect.latency:` the upstream's own answer time the limit keeps it to.",
    Place.PRIORITY: "`protect.priorities: [...]` one class of requests; the first whose match holds takes a "
                    "request, the last takes every request left. Listed from the most important to the least.",
    Place.QUEUE: "`protect.priorities[].queue:` requests of the priority that find no place wait for one, in "
                 "arrival order, instead of being refused at once; a place freed goes to the most important "
                 "priority waiting. Per worker only (scope: worker).",
    Place.PRIORITY_MATCH: "`protect.priorities[].match:` which requests the priority takes: the conditions of a "
                          "route's match (every one given must hold).",
    Place.RULE: "`routes[].limits: [...]` one rule; every rule must admit a request, and a refused request "
                "consumes nothing.",
    Place.KEYS: "`keys:` API keys and their plans, registered at runtime on the admin port (`/keys`), stored "
                "in Redis as digests; a route's `match: {plan: ...}` takes the callers of a plan (docs/api-keys.md).",
    Place.USE: "`routes[].limits: [{use: NAME}]` a rule of the top-level `shared:` list, in place of one of the "
               "route's own: ONE counter wherever it is used (docs/scaling.md: where its keys live).",
}


class Algorithm(StrEnum):
    """A rule's algorithm. A str: `rule.algorithm == "quota"` holds for Algorithm.QUOTA."""

    FIXED_WINDOW = "fixed_window"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_LOG = "sliding_log"
    TOKEN_BUCKET = "token_bucket"
    GCRA = "gcra"
    LEAKY_BUCKET = "leaky_bucket"
    QUOTA = "quota"
    CONCURRENCY = "concurrency"


WINDOW_ALGORITHMS = (Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW, Algorithm.SLIDING_LOG)
BUCKET_ALGORITHMS = (Algorithm.TOKEN_BUCKET, Algorithm.GCRA, Algorithm.LEAKY_BUCKET)
ALGORITHMS = tuple(Algorithm)

HEADER_MODES = ("draft", "legacy", "both", "none")
FAILURE_MODES = ("open", "closed")
PROTECT_SCOPES = ("worker", "fleet")
ON_MISSING = ("reject", "skip", "ip")
REDIS_MODES = ("standalone", "cluster", "sentinel")
CHECK_CONVENTIONS = ("auto", "forwarded", "original", "request_line")
JWT_ALGORITHMS = ("HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "ES256")

MAX_COST = 1_000_000_000
MAX_RULES = 32  # per route: one script decides them all, and its reply names the refusing one
MAX_PRIORITIES = 16
MAX_SHARDS = 1024  # per route: hash tags a route's keys spread over (docs/scaling.md)
SLIDING_LOG_MAX = 100_000  # sliding_log keeps one entry per request
MIN_WINDOW = 0.001  # seconds: Redis keeps expiry in milliseconds
MAX_SPAN = 100 * 365.25 * 86400.0  # seconds: a window, period or burst refill at most 100 years
MAX_OVERRIDES_BOUND = 10_000_000  # per rule: each worker holds every override of its routes in memory

NO_DEFAULT: Any = object()
_WINDOWS = WINDOW_ALGORITHMS
_BUCKETS = BUCKET_ALGORITHMS
_QUOTA = (Algorithm.QUOTA,)
_CONCURRENCY = (Algorithm.CONCURRENCY,)


@dataclass(frozen=True)
class Field:
    """One key. `required` is None for an optional key, else the hint after "is required"."""

    places: tuple[Place, ...]
    key: str
    kind: Kind
    doc: str
    default: Any = NO_DEFAULT       # the typed value when the key is absent
    required: str | None = None
    proxy_only: bool = False        # required only where the gateway forwards (not in the middleware)
    attr: str = ""                  # the model's attribute, when it is not `key`
    needed_by: tuple[Algorithm, ...] = ()    # rule parameters: the algorithms that need it ...
    optional_for: tuple[Algorithm, ...] = ()  # ... and those that may take it
    shown: str = ""                 # the default in words, when no value says it

    @property
    def name(self) -> str:
        return self.attr or self.key

    @property
    def is_parameter(self) -> bool:
        return bool(self.needed_by or self.optional_for)

    def shown_default(self) -> str | None:
        """The default as the docs show it; None when there is none to show (a rule parameter's
        default is the model's placeholder: the algorithms that use it require it)."""
        if self.shown:
            return self.shown
        if self.default is NO_DEFAULT or self.default is None or self.is_parameter:
            return None
        return self.kind.show(self.default)


def _f(place: Place | tuple[Place, ...], key: str, kind: Kind, doc: str, **more: Any) -> Field:
    return Field(place if isinstance(place, tuple) else (place,), key, kind, doc, **more)


TOP, REDIS, DEFAULTS, JWT, ADMIN = Place.TOP, Place.REDIS, Place.DEFAULTS, Place.JWT, Place.ADMIN
IDENTITY, LOCAL, UPSTREAM, TLS = Place.IDENTITY, Place.LOCAL_REFUSALS, Place.UPSTREAM, Place.TLS
ROUTE, MATCH, RULE = Place.ROUTE, Place.MATCH, Place.RULE
PMATCH = Place.PRIORITY_MATCH

FIELDS: tuple[Field, ...] = (
    _f(TOP, "version", Integer(1, 1), "Format version; only 1 exists.", required="(version: 1)"),
    _f(TOP, "redis", Section(REDIS), "Where limits are kept."),
    _f(TOP, "defaults", Section(DEFAULTS), "Policy for every route; a route may set the same keys again."),
    _f(TOP, "trusted_proxies", ListOf(Network()), "Peers whose X-Forwarded-For is believed (addresses or CIDRs).",
       default=()),
    _f(TOP, "upstreams", Named(UPSTREAM), "Named upstreams the routes forward to.",
       required="(at least one upstream)", proxy_only=True),
    _f(TOP, "keys", Section(Place.KEYS), "API keys and plans, registered at runtime (admin port /keys)."),
    _f(Place.KEYS, "source", Text(what="identity source"), "Where a request carries its key: any identity source "
       "(header:X-Api-Key, query:api_key, cookie:NAME, jwt:CLAIM).", required=""),
    _f(Place.KEYS, "unknown", Choice(("reject", "pass")), "A request whose key is not registered (or that has "
       "none): reject, a 401 problem+json, never forwarded; pass, its plan is `none`.", default="reject"),
    _f(Place.KEYS, "plans", ListOf(Name(), 255), "The plans a key may be registered with.", required=""),
    _f(TOP, "shared", ListOf(Section(RULE), MAX_RULES), "Rules several routes use by name ({use: NAME} in their "
       "limits), each keeping one counter wherever it is used, as nginx's limit_req_zone used by several "
       "locations."),
    _f(TOP, "routes", ListOf(Section(ROUTE)), "Tried in file order; the first match wins.",
       required="(at least one route)"),
    _f(TOP, "jwt", Section(JWT), "How jwt:CLAIM identities are verified."),
    _f(TOP, "admin", Section(ADMIN), "The admin port."),
    _f(TOP, "identity", Section(IDENTITY), "Bounds on identities."),
    _f(TOP, "access_log", Boolean(), "Log one line per request.", default=False),
    _f(TOP, "local_refusals", Section(LOCAL), "Refusals each worker answers from memory."),
    _f(TOP, "check", Section(Place.CHECK), "The check endpoint (--check-port): forward-auth."),
    _f(TOP, "rls", Section(Place.RLS), "Envoy's rate limit service (--rls-port)."),

    _f(Place.RLS, "files", ListOf(Text(what="path")), "envoyproxy/ratelimit config files, read as that server "
       "reads them (fixed windows aligned to the unit); relative to this file.", default=()),
    _f(Place.RLS, "domains", Named(Place.RLS_DOMAIN), "Domains in the gateway's own form: descriptors "
       "matched to rules of any algorithm."),
    _f(Place.RLS_DOMAIN, "descriptors", ListOf(Section(Place.RLS_DESCRIPTOR)), "The domain's descriptor "
       "entries.", required="(a domain without descriptors limits nothing)"),
    _f(Place.RLS_DOMAIN, "shards", Integer(1, MAX_SHARDS), "Redis Cluster: spread the domain's keys over this many "
       "hash tags; a call goes to the shard of its first counted descriptor's values, whose rule keeps its whole "
       "limit there, every other rule of the call its share (docs/scaling.md). Keep the descriptor that names the "
       "caller first in every Envoy route's actions.", default=1),
    _f(Place.RLS_DESCRIPTOR, "key", Text(r"^.{1,256}$", "must be 1 to 256 characters"), "The entry's key.",
       required=""),
    _f(Place.RLS_DESCRIPTOR, "value", Text(r"^.{0,256}$", "must be at most 256 characters"), "The entry's "
       "value; absent: any value, each with its own count; ending in `*`: values starting so.", default=""),
    _f(Place.RLS_DESCRIPTOR, "limit", Section(RULE), "The rule a descriptor ending here is counted by: any "
       "algorithm but concurrency, keyed by the descriptor's values (no `by`)."),
    _f(Place.RLS_DESCRIPTOR, "unlimited", Boolean(), "A descriptor ending here is OK and counted by nothing.",
       default=False),
    _f(Place.RLS_DESCRIPTOR, "replaces", ListOf(Name()), "Rules (by name) this one replaces when a request "
       "matches both: those are not counted.", default=()),
    _f(Place.RLS_DESCRIPTOR, "descriptors", ListOf(Section(Place.RLS_DESCRIPTOR)), "Entries that may follow "
       "this one."),

    _f(REDIS, "url", Url("^$|" + REDIS_SCHEMES.pattern, REDIS_SCHEMES_SAID, nullable=True, what="URL"),
       "redis://, rediss:// or unix://; empty: embedded. GATEWAY_REDIS_URL and --redis-url override it.",
       default=""),
    _f(REDIS, "mode", Choice(REDIS_MODES), "Redis topology.", default="standalone"),
    _f(REDIS, "timeout", Duration(), "Longest Redis may take to answer a decision, counted from when it is "
       "sent (docs/operations.md); past it the failure policy applies.", default=0.05),
    _f(REDIS, "key_prefix", Name(), "First part of every Redis key.", default="rlgw"),
    _f(REDIS, "sentinel_master", Name(), "Name of the primary the sentinels monitor (mode: sentinel).",
       default="mymaster"),

    _f(JWT, "algorithms", ListOf(Choice(JWT_ALGORITHMS)), "Accepted signature algorithms.", default=(),
       shown="HS256 with a secret, else RS256"),
    _f(JWT, "secret", Text(), "Shared secret for HS* (use ${NAME})."),
    _f(JWT, "public_key", Text(), "PEM public key for RS*/ES*."),
    _f(JWT, "public_key_file", Text(what="file"), "File holding the PEM public key."),
    _f(JWT, "audience", Text(), "Required aud claim."),
    _f(JWT, "issuer", Text(), "Required iss claim."),
    _f(JWT, "header", Text(), "Header carrying the bearer token.", default="authorization"),
    _f(JWT, "leeway", Duration(), "Clock skew allowed on exp/nbf.", default=0.0),

    _f(ADMIN, "token", Text(nullable=True), "Bearer token for admin writes (POST /reload, DELETE /limits); "
       "use ${ADMIN_TOKEN:-}. Unset: writes are accepted from loopback only.", attr="admin_token"),

    _f(IDENTITY, "body_max_bytes", Integer(1, 1 << 26), "Bytes of the body digested for `by: [body]`, and "
       "read for a token budget's reserve (a longer body on such a route is refused with 413).",
       default=65536, attr="body_digest_max_bytes"),
    _f(IDENTITY, "max_length", Integer(1, 65536), "Longest identity part kept as is (longer ones are hashed).",
       default=1024, attr="identity_max_bytes"),

    _f(Place.CHECK, "deny_status", Integer(400, 499), "Answer every refusal with this status instead, the "
       "original one in X-RateLimit-Status (403 for nginx auth_request, which turns any status but 2xx, 401 "
       "and 403 into a 500). Unset: the refusal's own status (429, 503, 400).", attr="check_deny_status"),
    _f(Place.CHECK, "convention", Choice(CHECK_CONVENTIONS), "Where the original request is read from: "
       "`forwarded` (X-Forwarded-Method/-Uri/-Host: Traefik, Caddy), `original` (X-Original-Method/-URI/-URL: "
       "nginx, ingress-nginx), `request_line` (Envoy ext_authz), or `auto`: the first of these that the check "
       "request carries. Name your proxy's: with `auto` a client's own X-Forwarded-Uri is believed unless the "
       "proxy strips it (docs/behind-a-proxy.md's recipes do).", default="auto", attr="check_convention"),
    _f(Place.CHECK, "path_prefix", Text(r"^(/[^?#]*)?$", "must be empty or a path starting with /", what="path"),
       "Taken off the front of the request line's path when no forwarding header names the original request "
       "(Envoy ext_authz's `path_prefix`).", default="", attr="check_path_prefix"),

    _f(LOCAL, "max_entries", Integer(0, 10_000_000), "Refusals kept per worker, least recently used dropped "
       "first; 0 turns it off (every request asks Redis).", default=100_000, attr="local_refusals_max"),
    _f(LOCAL, "max_hold", Duration(), "The longest a refusal is answered from memory before Redis is asked "
       "again: how long an admin reset of a key may take to reach the other workers and hosts.",
       default=1.0, attr="local_refusals_hold"),

    _f(UPSTREAM, "url", Url(r"^https?://[^/\s]+(/\S*)?$", "{value!r} must be an http:// or https:// URL", what="URL"),
       "http:// or https:// base URL.", required=""),
    _f(UPSTREAM, "timeout", Duration(), "Longest wait for the upstream's answer (504 past it).", default=10.0),
    _f(UPSTREAM, "connect_timeout", Duration(), "Longest wait to connect (504 past it, as nginx's "
       "proxy_connect_timeout; a refused connection is a 502).", default=1.0),
    _f(UPSTREAM, "max_connections", Integer(1, 100_000), "Connection pool size.", default=512),
    _f(UPSTREAM, "http2", Boolean(), "true: speak HTTP/2 to this upstream (needs an https:// url; "
       "negotiated by ALPN).", default=False),
    _f(UPSTREAM, "protect", Section(Place.PROTECT), "Keep the upstream's answer time near its unloaded value by "
       "limiting the requests in flight to it, refusing the least important first (docs/algorithms.md).",
       default=None),
    _f(Place.PROTECT, "latency", Section(Place.LATENCY), "The answer time to keep."),
    _f(Place.PROTECT, "priorities", ListOf(Section(Place.PRIORITY), MAX_PRIORITIES), "Classes of requests, the "
       "most important first.", default=(), shown="one: every request alike"),
    _f(Place.PROTECT, "min_limit", Integer(1, 100_000), "The in-flight limit never goes below this.", default=2),
    _f(Place.PROTECT, "max_limit", Integer(1, 100_000), "The in-flight limit never goes above this.",
       default=1000),
    _f(Place.PROTECT, "scope", Choice(PROTECT_SCOPES), "worker: each worker of each gateway holds a limit of its "
       "own; fleet: every gateway sharing the Redis holds one limit together, its slots taken and given back "
       "in Redis (docs/algorithms.md). Redis unavailable: failure_mode open falls back to the worker's own "
       "limit, closed answers 503 + Retry-After.", default="worker"),
    _f(Place.PROTECT, "lease", Duration(window=True), "scope fleet: how long a slot outlives a gateway that died "
       "holding it (a request in flight renews its lease while it lasts).", default=60.0, shown="60s"),
    _f(Place.LATENCY, "target", Duration(), "The answer time (at `percentile`) the limit keeps the upstream "
       "under: it shrinks while the answers are slower. Absent: twice the unloaded answer time; the limit "
       "aims at no less than 1.25 times the unloaded time whatever the target.", default=None,
       shown="2 x unloaded"),
    _f(Place.LATENCY, "percentile", Integer(50, 99), "The percentile of each window's answer times compared "
       "with the target.", default=90),
    _f(Place.PRIORITY, "name", Name(), "The priority's name, in metrics, logs and refusals.", required=""),
    _f(Place.PRIORITY, "match", Section(Place.PRIORITY_MATCH), "The requests it takes; the last priority "
       "has none: it takes every request left."),
    _f(Place.PRIORITY, "queue", Section(Place.QUEUE), "Wait for a place (a bounded queue with a deadline) "
       "instead of a refusal at once.", default=None, shown="none: refused at once"),
    _f(Place.QUEUE, "size", Integer(1, 100_000), "Requests that may wait at once; one more is refused (503) at "
       "once.", required=""),
    _f(Place.QUEUE, "timeout", Duration(), "The longest a request waits; past it, refused (503, "
       "Retry-After).", default=1.0),
    _f(Place.PRIORITY, "share", Integer(1, 100), "Percent of the in-flight limit its requests may fill; past it "
       "they are refused. Default: 100 for the first, 50 for the last, evenly between.",
       shown="100 first .. 50 last"),
    _f(UPSTREAM, "tls", Section(TLS), "CAs to trust, a client certificate for mutual TLS, and whether to "
       "verify the upstream's certificate (needs an https:// url).", default=None),

    _f(TLS, "ca", Text(what="file"), "PEM file of the CAs to trust (default: the system's).", default=None),
    _f(TLS, "cert", Text(what="file"), "Client certificate (PEM) for mutual TLS; needs key.", default=None),
    _f(TLS, "key", Text(what="file"), "Private key (PEM) of the client certificate.", default=None),
    _f(TLS, "verify", Boolean(), "Verify the upstream's certificate.", default=True),

    _f(ROUTE, "name", Name(), "The route's name, in metrics, logs and refusals.", required=""),
    _f(ROUTE, "match", Section(MATCH), "Which requests the route takes.", required=""),
    _f(ROUTE, "upstream", Text(what="upstream name"), "Name of an upstream.", required="", proxy_only=True),
    _f(ROUTE, "limits", ListOf(Section(RULE), MAX_RULES), "Every rule must admit a request; a refused request "
       f"consumes nothing. At most {MAX_RULES} rules.", default=()),
    _f((DEFAULTS, ROUTE), "failure_mode", Choice(FAILURE_MODES), "Redis unavailable: open forwards "
       "unlimited, closed answers 503 + Retry-After.", default="open"),
    _f((DEFAULTS, ROUTE), "headers", Choice(HEADER_MODES), "Rate-limit headers: draft (IETF RateLimit-Policy "
       "and RateLimit, each a list with every rule the request was counted by, the refusing or most restrictive "
       "first), legacy (X-RateLimit-Limit, -Remaining, -Reset of that rule, and Kong's -Limit-Minute, "
       "-Remaining-Minute per whole second, minute, hour or day window), both or none.", default="draft"),
    _f((DEFAULTS, ROUTE), "method_override", Choice(("honour", "ignore")), "A request carrying "
       "X-HTTP-Method-Override, X-HTTP-Method or X-Method-Override: honour matches and counts it as the method "
       "the field names, as the frameworks that read the field act on it; ignore: as its request line says, "
       "for an upstream that honours no override. HEAD is counted as GET either way.", default="honour"),
    _f(ROUTE, "respond", Choice(("usage",)), "usage: the route has no upstream and answers, for the caller as "
       "its request identifies it, every rule of the routes in usage_of it is counted by: limit, remaining and "
       "reset, as JSON (GitHub's GET /rate_limit). It charges nothing but its own limits."),
    _f(ROUTE, "usage_of", ListOf(Name()), "The routes a respond: usage route reports (default: every route with "
       "limits)."),
    _f(ROUTE, "websocket", Boolean(), "true: a WebSocket handshake (GET with Upgrade: websocket) is decided "
       "like any request and, if the upstream answers 101, tunneled both ways; false: every Upgrade is a 501.",
       default=False),
    _f((DEFAULTS, ROUTE), "websocket_idle_timeout", Duration(), "A tunnel with no byte either way for this long "
       "is closed.", default=3600.0),
    _f(ROUTE, "shards", Integer(1, MAX_SHARDS), "Redis Cluster: spread the route's keys over this many hash "
       "tags, chosen by the first rule's identity (docs/scaling.md). 1: every key in one slot, exact.",
       default=1),
    _f(ROUTE, "protect", Section(Place.PROTECT), "The route's own adaptive limit on its requests in flight to its "
       "upstream, in place of the upstream's `protect:` (docs/algorithms.md).", default=None),

    _f(MATCH, "path", Template(), "Path template: /items/{id}, /{rest:path}; "
       "{name:int} and {name:str} too.", required=""),
    _f(MATCH, "path_case", Choice(("sensitive", "insensitive")), "How the path template's letters match: "
       "`sensitive`, as RFC 3986, nginx and Envoy do; `insensitive` for an upstream that routes so (ASP.NET, "
       "Express by default), or /SECKILL/1 would pass this route by to a later one (docs/security.md).",
       default="sensitive"),
    _f(MATCH, "methods", ListOf(Text(r"^[A-Za-z]{1,20}$", "{value!r} is not an HTTP method", what="HTTP method")),
       "Methods the route owns (any other is a 405); absent: every method.", default=None),
    _f(MATCH, "plan", ListOf(Name(), single=True), "The plan (or plans) of the request's API key (`keys:`); "
       "`none`: a key unknown or absent, with keys.unknown: pass."),
    _f(MATCH, "host", HostName(), "Host the request must name (case-insensitive, without its port; an "
       "internationalized name as clients send it, xn--); absent: any.", default=None),
    _f(MATCH, "headers", Conditions(presence=True), "Headers the request must carry: NAME: VALUE, NAME: [VALUES] "
       "or NAME: true (present). Not met: the next route is tried.", default=None),
    _f(MATCH, "jwt", Conditions(), "Claims of a verified bearer token: CLAIM: VALUE or [VALUES] (needs the jwt: "
       "section). No token, or one that does not verify, meets none.", default=None),
    _f(MATCH, "client", ListOf(Network()), "Client addresses (CIDRs), as the ip identity reads them (after "
       "trusted_proxies). Not met: the next route is tried.", default=None),

    _f(PMATCH, "methods", ListOf(Text(r"^[A-Za-z]{1,20}$", "{value!r} is not an HTTP method", what="HTTP method")),
       "Methods it takes; absent: every method."),
    _f(PMATCH, "plan", ListOf(Name(), single=True), "The plan (or plans) of the request's API key (`keys:`)."),
    _f(PMATCH, "headers", Conditions(presence=True), "Headers the request carries: NAME: VALUE, NAME: [VALUES] or "
       "NAME: true (present)."),
    _f(PMATCH, "jwt", Conditions(), "Claims of a verified bearer token: CLAIM: VALUE or [VALUES] (needs the jwt: "
       "section)."),
    _f(PMATCH, "client", ListOf(Network()), "Client addresses (CIDRs), as the ip identity reads them."),

    _f(RULE, "name", Name(), "The rule's name, in RateLimit-Policy, refusals and metrics.", required=""),
    _f(Place.USE, "use", Name(), "The name of a rule of `shared:`; alone in its mapping.", required=""),
    _f(RULE, "by", ListOf(Source()), "Identity sources; [] is one key shared by every request of the route. "
       "`consumer` (with `keys:`) counts every key of one consumer together, so a rotated key keeps the budget.",
       required="([] for one shared key)"),
    _f(RULE, "algorithm", Choice(ALGORITHMS), "How the rule counts (README: the algorithms).", required=""),
    _f(RULE, "limit", Integer(1, 1_000_000_000), "Requests per window (windows), in total (quota) or "
       "in flight at once (concurrency).",
       default=0, needed_by=(*_WINDOWS, *_QUOTA, *_CONCURRENCY)),
    _f(RULE, "window", Window(window=True), "Window length: 1ms to 100 years; for fixed_window also `day`, "
       "`week` (from Monday) or `month` (from the 1st), reset at local midnight of `calendar`.", default=0.0,
       needed_by=_WINDOWS),
    _f(RULE, "rate", Rate(), "Refill or leak rate.", default=0.0, needed_by=_BUCKETS),
    _f(RULE, "burst", Integer(1, 1_000_000_000), "Bucket size (token_bucket, gcra) or queue length "
       "(leaky_bucket).", default=0, needed_by=_BUCKETS),
    _f(RULE, "period", Window(window=True), "Refill the whole limit every period: 1ms to 100 years, or "
       "`day`, `week` (from Monday) or `month` (from the 1st), reset at local midnight of `calendar`.",
       attr="window", optional_for=_QUOTA, shown="never"),
    _f(RULE, "calendar", Zone(), "The time zone of a day, week or month window or "
       "period: its resets are local midnights (a day across a daylight-saving change is 23 or 25 hours). A zone "
       "of the tzdata package, read from it whatever the host's zone files say; not `localtime`.",
       default="UTC", optional_for=(Algorithm.FIXED_WINDOW, Algorithm.QUOTA)),
    _f(RULE, "lease", Duration(window=True), "concurrency: how long a slot outlives a gateway that died holding "
       "it (a request in flight renews its lease while it lasts).", default=60.0, optional_for=_CONCURRENCY,
       shown="60s"),
    _f(RULE, "cost", Cost(MAX_COST), "Units one request spends: a number, header:NAME (the client declares "
       "it), or response_header:NAME (the upstream declares it in its answer, which is charged then; the "
       "header is removed before the client sees it); or a token budget's `{reserve: request_json:FIELD, "
       "default: N, max: N, settle: response_json:PATH}`: FIELD of the request's JSON body, read as the "
       "upstream reads it (the largest of max_tokens, max_completion_tokens, max_output_tokens, times n; N "
       "when absent; a `total_tokens` budget adds the body's bytes for the prompt), is charged at admission; "
       "a reserve over `max` (default: the rule's limit) or unreadable is refused (400, 413 for a body over "
       "identity.body_max_bytes); the difference to PATH of the answer's JSON, or of the last Server-Sent "
       "Event that carries it, is charged or given back when the answer ends (docs/algorithms.md, token "
       "budgets).",
       default=1),
    _f(RULE, "count_on", ListOf(Status()), "Charge only answers with these statuses or classes ([401, 403], "
       "[5xx]), when the answer comes; the rule refuses once its budget is spent.", default=()),
    _f(RULE, "refund_on", ListOf(Status()), "Give back the units charged at admission when the answer has one "
       "of these statuses or classes (the gateway's own 502 and 504 included).", default=()),
    _f(RULE, "status", Integer(400, 599), "Status of a refusal.", default=429),
    _f(RULE, "shadow", Boolean(), "Evaluate and count, never refuse.", default=False),
    _f(RULE, "on_missing", Choice(ON_MISSING), "Identity absent: reject (400), skip the rule, or fall back "
       "to ip.", default="reject"),
    _f(RULE, "max_overrides", Integer(0, MAX_OVERRIDES_BOUND), "Per-identity overrides the rule may hold "
       "(PUT /overrides on the admin port); 0: none.", default=100_000),
)


def fields(place: Place) -> Iterator[Field]:
    return (f for f in FIELDS if place in f.places)


def keys(place: Place) -> tuple[str, ...]:
    """The allow-list of `place`, in the table's order."""
    return tuple(f.key for f in fields(place))


def field(place: Place, key: str) -> Field:
    return next(f for f in fields(place) if f.key == key)


def default(place: Place, key: str) -> Any:
    """The model's starting value for `key` (see model.py)."""
    value = field(place, key).default
    assert value is not NO_DEFAULT, f"{place}.{key} has no default"
    return value


def parameters(algorithm: Algorithm) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The rule keys `algorithm` needs, and those it may take."""
    params = [f for f in fields(RULE) if f.is_parameter]
    return (tuple(f.key for f in params if algorithm in f.needed_by),
            tuple(f.key for f in params if algorithm in f.optional_for))


PARAMETERS = tuple(f.key for f in fields(RULE) if f.is_parameter)
PARAMS_FOR = {a.value: parameters(a)[0] for a in Algorithm}
OPTIONAL_FOR = {a.value: parameters(a)[1] for a in Algorithm if parameters(a)[1]}
