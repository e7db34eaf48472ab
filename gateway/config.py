"""routes.yaml -> validated, frozen objects.

Every key is checked against an allow-list; every problem names the file, the line and the key, and
all problems are reported together. `${NAME}` and `${NAME:-default}` are replaced from the
environment before a value is typed.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gateway.errors import ConfigError, ConfigProblem
from gateway.http.request import HOP_BY_HOP
from gateway.units import parse_duration, parse_rate

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NODES = 200_000
MAX_DEPTH = 40
MAX_COST = 1_000_000_000
MAX_RULES = 32  # per route: one script decides them all, and its reply names the refusing one
MAX_SHARDS = 1024  # per route: hash tags a route's keys spread over (docs/scaling.md)
MIN_WINDOW = 0.001  # seconds: Redis keeps expiry in milliseconds
MAX_SPAN = 100 * 365.25 * 86400.0  # seconds: a window, period or burst refill at most 100 years
LOCAL_REFUSALS_MAX = 100_000  # refusals each worker keeps in memory by default (gateway/refusals.py)
LOCAL_REFUSALS_HOLD = 1.0     # seconds a refusal is answered from memory at most before Redis is asked again

ALGORITHMS = (
    "fixed_window", "sliding_window", "sliding_log",
    "token_bucket", "gcra", "leaky_bucket", "quota",
)
WINDOW_ALGORITHMS = ("fixed_window", "sliding_window", "sliding_log")
BUCKET_ALGORITHMS = ("token_bucket", "gcra", "leaky_bucket")
HEADER_MODES = ("draft", "legacy", "both", "none")
FAILURE_MODES = ("open", "closed")
ON_MISSING = ("reject", "skip", "ip")
REDIS_MODES = ("standalone", "cluster", "sentinel")
SOURCE_KINDS = ("ip", "method", "body", "header", "query", "path", "cookie", "jwt")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(path|str|int))?\}")


@dataclass(frozen=True)
class RedisSettings:
    url: str = ""
    mode: str = "standalone"
    timeout: float = 0.05
    key_prefix: str = "rlgw"
    sentinel_master: str = "mymaster"


@dataclass(frozen=True)
class UpstreamTls:
    ca: str | None = None       # PEM file of the CAs to trust (default: the system's)
    cert: str | None = None     # client certificate (PEM) for mutual TLS ...
    key: str | None = None      # ... and its private key
    verify: bool = True


@dataclass(frozen=True)
class Upstream:
    name: str
    url: str
    timeout: float = 10.0
    connect_timeout: float = 1.0
    max_connections: int = 512
    http2: bool = False
    tls: UpstreamTls | None = None


@dataclass(frozen=True)
class Source:
    kind: str
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" if self.name else self.kind


@dataclass(frozen=True)
class Rule:
    name: str
    by: tuple[Source, ...]
    algorithm: str
    limit: int = 0          # windows and quota
    window: float = 0.0     # seconds; windows; quota period (0 = never refills)
    rate: float = 0.0       # per second; buckets
    burst: int = 0          # buckets
    cost: int = 1
    cost_header: str | None = None
    status: int = 429
    shadow: bool = False
    on_missing: str = "reject"

    @property
    def capacity(self) -> int:
        """The largest cost this rule can ever admit at once."""
        if self.algorithm == "leaky_bucket":
            return self.burst + 1
        return self.burst if self.algorithm in BUCKET_ALGORITHMS else self.limit

    @property
    def quota_size(self) -> int:
        return self.burst if self.algorithm in BUCKET_ALGORITHMS else self.limit

    @property
    def policy_window(self) -> float:
        """Seconds the quota is measured over, for RateLimit-Policy (0 = no window)."""
        if self.algorithm in BUCKET_ALGORITHMS:
            return self.burst / self.rate
        return self.window


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    methods: frozenset[str] | None
    host: str | None
    upstream: Upstream | None  # None only where the middleware guards an app in-process
    limits: tuple[Rule, ...]
    failure_mode: str = "open"
    headers: str = "draft"
    shards: int = 1            # hash tags the route's keys spread over (Redis Cluster)

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
    algorithms: tuple[str, ...] = ()
    secret: str | None = None
    public_key: str | None = None
    audience: str | None = None
    issuer: str | None = None
    header: str = "authorization"
    leeway: float = 0.0


@dataclass(frozen=True)
class Config:
    source: str
    redis: RedisSettings
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    upstreams: Mapping[str, Upstream]
    routes: tuple[Route, ...]
    jwt: JwtSettings = field(default_factory=JwtSettings)
    admin_token: str | None = None
    body_digest_max_bytes: int = 65536
    identity_max_bytes: int = 1024
    access_log: bool = False
    local_refusals_max: int = LOCAL_REFUSALS_MAX  # 0: every request asks Redis
    local_refusals_hold: float = LOCAL_REFUSALS_HOLD  # how stale an admin reset may be elsewhere


T = TypeVar("T")
_MISSING = object()


class _Reader:
    """Walks the YAML node tree, typing values and collecting problems with their lines."""

    def __init__(self, file: str, env: Mapping[str, str], proxy: bool = True) -> None:
        self.proxy = proxy  # False: rules guarding an app in-process (routes need no upstream)
        self.file = file
        self.env = env
        self.problems: list[ConfigProblem] = []

    def problem(self, node: yaml.Node | None, key: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.problems.append(ConfigProblem(self.file, line, key, message))

    def mapping(
        self, node: yaml.Node, key: str, allowed: tuple[str, ...]
    ) -> dict[str, yaml.Node] | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, key or "(document)", "must be a mapping")
            return None
        out: dict[str, yaml.Node] = {}
        for knode, vnode in node.value:
            name = knode.value if isinstance(knode, yaml.ScalarNode) else None
            shown = name if name else "(empty key)" if name == "" else "(non-text key)"
            path = f"{key}.{shown}" if key else shown
            if name not in allowed:
                hint = ", ".join(allowed)
                self.problem(knode, path, f"unknown key (allowed here: {hint})")
            elif name in out:
                self.problem(knode, path, "appears twice")
            else:
                out[name] = vnode
        return out

    def sequence(self, node: yaml.Node, key: str) -> list[yaml.Node] | None:
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, key, "must be a list")
            return None
        return list(node.value)

    def text(self, node: yaml.Node, key: str) -> str | None:
        if not isinstance(node, yaml.ScalarNode):
            self.problem(node, key, "must be a single value")
            return None
        raw = str(node.value)

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                return default
            self.problem(node, key, f"environment variable {name} is not set (use ${{{name}:-}})")
            return ""

        return ENV_REF.sub(substitute, raw)

    def typed(self, node: yaml.Node, key: str, kind: str, parse: Callable[[str], T]) -> T | None:
        text = self.text(node, key)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError as exc:
            self.problem(node, key, f"must be {kind}: {exc}")
            return None

    def string(self, node: yaml.Node, key: str) -> str | None:
        return self.text(node, key)

    def integer(self, node: yaml.Node, key: str, low: int, high: int) -> int | None:
        def parse(text: str) -> int:
            value = int(text.strip())
            if not low <= value <= high:
                raise ValueError(f"{value} is outside {low}..{high}")
            return value

        return self.typed(node, key, "a whole number", parse)

    def boolean(self, node: yaml.Node, key: str) -> bool | None:
        def parse(text: str) -> bool:
            lowered = text.strip().lower()
            if lowered in ("true", "yes", "on", "1"):
                return True
            if lowered in ("false", "no", "off", "0"):
                return False
            raise ValueError(f"{text!r} is not true or false")

        return self.typed(node, key, "true or false", parse)

    def choice(self, node: yaml.Node, key: str, options: tuple[str, ...]) -> str | None:
        def parse(text: str) -> str:
            if text not in options:
                raise ValueError(f"{text!r} is not one of {', '.join(options)}")
            return text

        return self.typed(node, key, "one of the known values", parse)

    def duration(self, node: yaml.Node, key: str) -> float | None:
        return self.typed(node, key, "a duration", parse_duration)

    def name(self, node: yaml.Node, key: str) -> str | None:
        def parse(text: str) -> str:
            if not NAME.match(text):
                raise ValueError(f"{text!r} must be 1-64 of A-Z a-z 0-9 _ . - (starting alnum)")
            return text

        return self.typed(node, key, "a name", parse)


def _check_shape(node: yaml.Node, reader: _Reader) -> bool:
    """Refuse documents that are absurdly deep or large before walking them."""
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(node, 1)]
    seen: set[int] = set()
    while stack:
        current, depth = stack.pop()
        if id(current) in seen:
            reader.problem(current, "(document)", "YAML aliases are not supported")
            return False
        seen.add(id(current))
        count += 1
        if depth > MAX_DEPTH or count > MAX_NODES:
            reader.problem(current, "(document)", "too deeply nested or too large")
            return False
        if isinstance(current, yaml.MappingNode):
            for k, v in current.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in current.value)
    return True


def load_config(path: str | Path, env: Mapping[str, str] | None = None, proxy: bool = True) -> Config:
    """Read and validate one routes.yaml. Raises ConfigError listing every problem.

    proxy=False: for the in-process middleware, where routes need no upstream (SPEC section 6)."""
    file = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError([ConfigProblem(file, 0, "(file)", f"cannot read: {exc.strerror}")]) from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([ConfigProblem(file, 0, "(file)", "larger than 4 MiB")])
    return parse_config(data, file, os.environ if env is None else env, proxy)


def parse_config(data: bytes | str, file: str, env: Mapping[str, str], proxy: bool = True) -> Config:
    reader = _Reader(file, env, proxy)
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigProblem(file, 1, "(document)", f"not UTF-8: {exc}")]) from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        message = f"not valid YAML: {exc.problem or exc.context}"
        if "expected ',' or '}'" in message or "expected ',' or ']'" in message:
            message += ' (a value containing { } inside a {...} mapping must be quoted: path: "/items/{id}")'
        raise ConfigError([ConfigProblem(file, line, "(document)", message)]) from exc
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError([ConfigProblem(file, 1, "(document)", f"not valid YAML: {exc}")]) from exc
    if root is None:
        raise ConfigError([ConfigProblem(file, 1, "(document)", "the file is empty")])
    if not _check_shape(root, reader):
        raise ConfigError(reader.problems)
    config = _build(root, reader)
    if reader.problems or config is None:
        raise ConfigError(reader.problems)
    return config


TOP_KEYS = (
    "version", "redis", "defaults", "trusted_proxies", "upstreams", "routes", "jwt", "admin",
    "identity", "access_log", "local_refusals",
)


def _build(root: yaml.Node, r: _Reader) -> Config | None:
    top = r.mapping(root, "", TOP_KEYS)
    if top is None:
        return None
    if "version" not in top:
        r.problem(root, "version", "is required (version: 1)")
    elif r.integer(top["version"], "version", 1, 1) is None:
        pass
    redis = _redis(top.get("redis"), r)
    defaults = _policy(top.get("defaults"), "defaults", r, {"failure_mode": "open", "headers": "draft"})
    proxies = _proxies(top.get("trusted_proxies"), r)
    jwt = _jwt(top.get("jwt"), r)
    admin_token = None
    if "admin" in top:
        admin = r.mapping(top["admin"], "admin", ("token",))
        if admin and "token" in admin:
            admin_token = r.string(admin["token"], "admin.token") or None
    body_max, ident_max = 65536, 1024
    if "identity" in top:
        ident = r.mapping(top["identity"], "identity", ("body_max_bytes", "max_length"))
        if ident and "body_max_bytes" in ident:
            body_max = r.integer(ident["body_max_bytes"], "identity.body_max_bytes", 1, 1 << 26) or 0
        if ident and "max_length" in ident:
            ident_max = r.integer(ident["max_length"], "identity.max_length", 1, 65536) or 0
    access_log = False
    if "access_log" in top:
        access_log = bool(r.boolean(top["access_log"], "access_log"))
    local_refusals, local_hold = LOCAL_REFUSALS_MAX, LOCAL_REFUSALS_HOLD
    if "local_refusals" in top:
        refusals = r.mapping(top["local_refusals"], "local_refusals", ("max_entries", "max_hold"))
        if refusals and "max_entries" in refusals:
            found = r.integer(refusals["max_entries"], "local_refusals.max_entries", 0, 10_000_000)
            local_refusals = LOCAL_REFUSALS_MAX if found is None else found
        if refusals and "max_hold" in refusals:
            hold = r.duration(refusals["max_hold"], "local_refusals.max_hold")
            local_hold = LOCAL_REFUSALS_HOLD if hold is None else hold
    upstreams = _upstreams(top.get("upstreams"), r, root)
    routes = _routes(top.get("routes"), r, root, upstreams, defaults, jwt)
    if r.problems:
        return None
    return Config(
        source=r.file,
        redis=redis,
        trusted_proxies=proxies,
        upstreams=upstreams,
        routes=routes,
        jwt=jwt,
        admin_token=admin_token,
        body_digest_max_bytes=body_max,
        identity_max_bytes=ident_max,
        access_log=access_log,
        local_refusals_max=local_refusals,
        local_refusals_hold=local_hold,
    )


def _redis(node: yaml.Node | None, r: _Reader) -> RedisSettings:
    if node is None:
        return RedisSettings()
    keys = ("url", "mode", "timeout", "key_prefix", "sentinel_master")
    m = r.mapping(node, "redis", keys)
    if m is None:
        return RedisSettings()
    values: dict[str, Any] = {}
    if "url" in m:
        url = r.string(m["url"], "redis.url") or ""
        if url and not re.match(r"^(redis|rediss|unix)://", url):
            r.problem(m["url"], "redis.url", "must start with redis://, rediss:// or unix://")
        values["url"] = url
    if "mode" in m:
        values["mode"] = r.choice(m["mode"], "redis.mode", REDIS_MODES) or "standalone"
    if "timeout" in m:
        values["timeout"] = r.duration(m["timeout"], "redis.timeout") or 0.05
    if "key_prefix" in m:
        values["key_prefix"] = r.name(m["key_prefix"], "redis.key_prefix") or "rlgw"
    if "sentinel_master" in m:
        values["sentinel_master"] = r.name(m["sentinel_master"], "redis.sentinel_master") or ""
    return RedisSettings(**values)


def _policy(
    node: yaml.Node | None, key: str, r: _Reader, inherited: dict[str, str]
) -> dict[str, str]:
    out = dict(inherited)
    if node is None:
        return out
    m = r.mapping(node, key, ("failure_mode", "headers"))
    if m is None:
        return out
    if "failure_mode" in m:
        out["failure_mode"] = r.choice(m["failure_mode"], f"{key}.failure_mode", FAILURE_MODES) or "open"
    if "headers" in m:
        out["headers"] = r.choice(m["headers"], f"{key}.headers", HEADER_MODES) or "draft"
    return out


def _proxies(
    node: yaml.Node | None, r: _Reader
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    if node is None:
        return ()
    items = r.sequence(node, "trusted_proxies")
    out = []
    for i, item in enumerate(items or []):
        key = f"trusted_proxies[{i}]"
        net = r.typed(item, key, "an address or CIDR", lambda t: ipaddress.ip_network(t.strip()))
        if net is not None:
            out.append(net)
    return tuple(out)


def _jwt(node: yaml.Node | None, r: _Reader) -> JwtSettings:
    if node is None:
        return JwtSettings()
    keys = ("algorithms", "secret", "public_key", "public_key_file", "audience", "issuer",
            "header", "leeway")
    m = r.mapping(node, "jwt", keys)
    if m is None:
        return JwtSettings()
    algorithms: list[str] = []
    for i, item in enumerate(r.sequence(m["algorithms"], "jwt.algorithms") or [] if "algorithms" in m else []):
        alg = r.choice(item, f"jwt.algorithms[{i}]", ("HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "ES256"))
        if alg:
            algorithms.append(alg)
    secret = r.string(m["secret"], "jwt.secret") if "secret" in m else None
    public_key = r.string(m["public_key"], "jwt.public_key") if "public_key" in m else None
    if "public_key_file" in m:
        path = r.string(m["public_key_file"], "jwt.public_key_file")
        if path:
            try:
                public_key = Path(path).read_text()
            except OSError as exc:
                r.problem(m["public_key_file"], "jwt.public_key_file", f"cannot read: {exc.strerror}")
    if not algorithms:
        algorithms = ["HS256"] if secret else ["RS256"]
    if any(a.startswith("HS") for a in algorithms) and not secret:
        r.problem(node, "jwt.secret", "is required for HS* algorithms")
    if any(not a.startswith("HS") for a in algorithms) and not public_key:
        r.problem(node, "jwt.public_key", "is required for RS*/ES* algorithms")
    header = "authorization"
    if "header" in m:
        header = (r.string(m["header"], "jwt.header") or header).lower()
    leeway = 0.0
    if "leeway" in m:
        leeway = r.duration(m["leeway"], "jwt.leeway") or 0.0
    return JwtSettings(
        algorithms=tuple(algorithms),
        secret=secret or None,
        public_key=public_key or None,
        audience=r.string(m["audience"], "jwt.audience") if "audience" in m else None,
        issuer=r.string(m["issuer"], "jwt.issuer") if "issuer" in m else None,
        header=header,
        leeway=leeway,
    )


def _upstreams(node: yaml.Node | None, r: _Reader, root: yaml.Node) -> dict[str, Upstream]:
    if node is None:
        if r.proxy:
            r.problem(root, "upstreams", "is required (at least one upstream)")
        return {}
    if not isinstance(node, yaml.MappingNode):
        r.problem(node, "upstreams", "must be a mapping of name -> upstream")
        return {}
    out: dict[str, Upstream] = {}
    for knode, vnode in node.value:
        name = r.name(knode, "upstreams")
        if name is None:
            continue
        key = f"upstreams.{name}"
        m = r.mapping(vnode, key, ("url", "timeout", "connect_timeout", "max_connections", "http2", "tls"))
        if m is None:
            continue
        if "url" not in m:
            r.problem(vnode, f"{key}.url", "is required")
            continue
        url = r.string(m["url"], f"{key}.url") or ""
        if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
            r.problem(m["url"], f"{key}.url", f"{url!r} must be an http:// or https:// URL")
        values: dict[str, Any] = {}
        if "timeout" in m:
            values["timeout"] = r.duration(m["timeout"], f"{key}.timeout") or 10.0
        if "connect_timeout" in m:
            values["connect_timeout"] = r.duration(m["connect_timeout"], f"{key}.connect_timeout") or 1.0
        if "max_connections" in m:
            values["max_connections"] = r.integer(m["max_connections"], f"{key}.max_connections", 1, 100_000) or 512
        if "http2" in m:
            values["http2"] = bool(r.boolean(m["http2"], f"{key}.http2"))
            if values["http2"] and not url.startswith("https://"):
                r.problem(m["http2"], f"{key}.http2", "HTTP/2 to an upstream needs an https:// url (ALPN)")
        if "tls" in m:
            values["tls"] = _tls(m["tls"], f"{key}.tls", r)
            if not url.startswith("https://"):
                r.problem(m["tls"], f"{key}.tls", "tls settings need an https:// url")
        out[name] = Upstream(name=name, url=url.rstrip("/"), **values)
    return out


def _tls(node: yaml.Node, key: str, r: _Reader) -> UpstreamTls | None:
    m = r.mapping(node, key, ("ca", "cert", "key", "verify"))
    if m is None:
        return None
    files: dict[str, str | None] = {}
    for name in ("ca", "cert", "key"):
        files[name] = r.string(m[name], f"{key}.{name}") if name in m else None
        path = files[name]
        if path and not os.path.isfile(path):
            r.problem(m[name], f"{key}.{name}", f"no such file: {path}")
    if (files["cert"] is None) != (files["key"] is None):
        r.problem(node, key, "cert and key go together (a client certificate and its private key)")
    verify = r.boolean(m["verify"], f"{key}.verify") if "verify" in m else True
    return UpstreamTls(ca=files["ca"], cert=files["cert"], key=files["key"], verify=verify is not False)


def path_params(template: str) -> list[str]:
    return [m.group(1) for m in PARAM.finditer(template)]


def _routes(
    node: yaml.Node | None,
    r: _Reader,
    root: yaml.Node,
    upstreams: dict[str, Upstream],
    defaults: dict[str, str],
    jwt: JwtSettings,
) -> tuple[Route, ...]:
    if node is None:
        r.problem(root, "routes", "is required (at least one route)")
        return ()
    items = r.sequence(node, "routes") or []
    out: list[Route] = []
    names: set[str] = set()
    for i, item in enumerate(items):
        route = _route(item, f"routes[{i}]", r, upstreams, defaults, jwt)
        if route is None:
            continue
        if route.name in names:
            r.problem(item, f"routes[{i}].name", f"route '{route.name}' is defined twice")
        names.add(route.name)
        out.append(route)
    return tuple(out)


ROUTE_KEYS = ("name", "match", "upstream", "limits", "failure_mode", "headers", "shards")


def _route(
    node: yaml.Node,
    key: str,
    r: _Reader,
    upstreams: dict[str, Upstream],
    defaults: dict[str, str],
    jwt: JwtSettings,
) -> Route | None:
    m = r.mapping(node, key, ROUTE_KEYS)
    if m is None:
        return None
    required = ("name", "match", "upstream") if r.proxy else ("name", "match")
    for needed in required:
        if needed not in m:
            r.problem(node, f"{key}.{needed}", "is required")
    if any(needed not in m for needed in required):
        return None
    name = r.name(m["name"], f"{key}.name")
    key = f"{key}({name})" if name else key
    match = r.mapping(m["match"], f"{key}.match", ("path", "methods", "host"))
    path, methods, host = "/", None, None
    if match is not None:
        if "path" not in match:
            r.problem(m["match"], f"{key}.match.path", "is required")
        else:
            path = r.string(match["path"], f"{key}.match.path") or "/"
            problem = _check_template(path)
            if problem:
                r.problem(match["path"], f"{key}.match.path", problem)
        if "methods" in match:
            found = []
            for j, mnode in enumerate(r.sequence(match["methods"], f"{key}.match.methods") or []):
                method = r.string(mnode, f"{key}.match.methods[{j}]")
                if method is not None:
                    if not re.match(r"^[A-Za-z]{1,20}$", method):
                        r.problem(mnode, f"{key}.match.methods[{j}]", f"{method!r} is not an HTTP method")
                    found.append(method.upper())
            methods = frozenset(found)
        if "host" in match:
            host = (r.string(match["host"], f"{key}.match.host") or "").lower() or None
    upstream_name = r.string(m["upstream"], f"{key}.upstream") if "upstream" in m else None
    upstream = upstreams.get(upstream_name or "")
    if upstream is None and upstream_name is not None:
        known = ", ".join(sorted(upstreams)) or "none defined"
        r.problem(m["upstream"], f"{key}.upstream", f"no upstream named {upstream_name!r} (known: {known})")
    policy = dict(defaults)
    for pkey in ("failure_mode", "headers"):
        if pkey in m:
            options = FAILURE_MODES if pkey == "failure_mode" else HEADER_MODES
            policy[pkey] = r.choice(m[pkey], f"{key}.{pkey}", options) or policy[pkey]
    rules: list[Rule] = []
    rule_nodes: list[yaml.Node] = []
    params = path_params(path)
    if "limits" in m:
        rule_names: set[str] = set()
        for j, rnode in enumerate(r.sequence(m["limits"], f"{key}.limits") or []):
            if j == MAX_RULES:
                r.problem(rnode, f"{key}.limits[{j}]", f"a route holds at most {MAX_RULES} rules")
            rule = _rule(rnode, f"{key}.limits[{j}]", r, params, jwt)
            if rule is None:
                continue
            if rule.name in rule_names:
                r.problem(rnode, f"{key}.limits[{j}].name", f"rule '{rule.name}' is defined twice")
            rule_names.add(rule.name)
            rules.append(rule)
            rule_nodes.append(rnode)
    shards = 1
    if "shards" in m:
        shards = r.integer(m["shards"], f"{key}.shards", 1, MAX_SHARDS) or 1
        if shards > 1:
            _check_shards(m["shards"], key, r, rules, rule_nodes, shards)
    if name is None or (upstream is None and r.proxy):
        return None
    return Route(
        name=name,
        path=path,
        methods=methods,
        host=host,
        upstream=upstream,
        limits=tuple(rules),
        failure_mode=policy["failure_mode"],
        headers=policy["headers"],
        shards=shards,
    )


def _check_shards(
    snode: yaml.Node, key: str, r: _Reader, rules: list[Rule], nodes: list[yaml.Node], shards: int
) -> None:
    """A sharded route needs an identity to spread by, and every split rule a share of at least
    one (and of at least its cost) in every shard."""
    if not rules:
        r.problem(snode, f"{key}.shards", "a route without limits has nothing to shard")
        return
    first = rules[0]
    if not first.by:
        r.problem(snode, f"{key}.shards",
                  f"the first rule ({first.name!r}) has no identity (by: []): nothing to spread the shards by")
        return
    if first.on_missing == "skip":
        r.problem(snode, f"{key}.shards",
                  f"the first rule ({first.name!r}) has on_missing: skip: a request without its identity "
                  "would have no shard (use reject or ip)")
    for j, (rule, rnode) in enumerate(zip(rules, nodes, strict=True)):
        if keeps_full_limit(first, rule):
            continue
        where = f"{key}.limits[{j}]({rule.name})"
        field = "burst" if rule.algorithm in BUCKET_ALGORITHMS else "limit"
        node = _child(rnode, field) or rnode
        total = rule.quota_size
        if total < shards:
            r.problem(node, f"{where}.{field}",
                      f"{field} {total} is split over shards: {shards}; each shard needs at least 1 "
                      f"(use shards <= {total}, or give the rule the first rule's identity)")
            continue
        smallest = shard_share(total, shards, shards - 1) + (1 if rule.algorithm == "leaky_bucket" else 0)
        if rule.cost > smallest:
            r.problem(_child(rnode, "cost") or node, f"{where}.cost",
                      f"cost {rule.cost} can never fit a shard's share ({smallest} of {field} {total} "
                      f"over shards: {shards})")


def _child(node: yaml.Node, name: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            if isinstance(knode, yaml.ScalarNode) and knode.value == name:
                assert isinstance(vnode, yaml.Node)
                return vnode
    return None


def _check_template(path: str) -> str | None:
    if not path.startswith("/"):
        return f"{path!r} must start with /"
    stripped = PARAM.sub("", path)
    if "{" in stripped or "}" in stripped:
        return f"{path!r} has a malformed {{parameter}} (use {{name}} or {{name:path}})"
    names = path_params(path)
    if len(set(names)) != len(names):
        return f"{path!r} names a parameter twice"
    for m in PARAM.finditer(path):
        if m.group(2) == "path" and m.end() != len(path):
            return f"{path!r}: a {{name:path}} parameter must come last"
    return None


RULE_KEYS = (
    "name", "by", "algorithm", "limit", "window", "rate", "burst", "period",
    "cost", "status", "shadow", "on_missing",
)
PARAMS_FOR = {
    "fixed_window": ("limit", "window"),
    "sliding_window": ("limit", "window"),
    "sliding_log": ("limit", "window"),
    "token_bucket": ("rate", "burst"),
    "gcra": ("rate", "burst"),
    "leaky_bucket": ("rate", "burst"),
    "quota": ("limit",),
}
OPTIONAL_FOR = {"quota": ("period",)}


def _rule(
    node: yaml.Node, key: str, r: _Reader, params: list[str], jwt: JwtSettings
) -> Rule | None:
    m = r.mapping(node, key, RULE_KEYS)
    if m is None:
        return None
    if "name" not in m or "algorithm" not in m:
        for required in ("name", "algorithm"):
            if required not in m:
                r.problem(node, f"{key}.{required}", "is required")
        return None
    name = r.name(m["name"], f"{key}.name")
    key = f"{key}({name})" if name else key
    algorithm = r.choice(m["algorithm"], f"{key}.algorithm", ALGORITHMS)
    if name is None or algorithm is None:
        return None
    needed = PARAMS_FOR[algorithm]
    optional = OPTIONAL_FOR.get(algorithm, ())
    for pkey in ("limit", "window", "rate", "burst", "period"):
        if pkey in m and pkey not in needed and pkey not in optional:
            takes = ", ".join(needed + optional)
            r.problem(m[pkey], f"{key}.{pkey}", f"is not a parameter of {algorithm} (it takes {takes})")
    for pkey in needed:
        if pkey not in m:
            r.problem(node, f"{key}.{pkey}", f"is required by {algorithm}")
    values: dict[str, Any] = {}
    if "limit" in m and "limit" in needed:
        values["limit"] = r.integer(m["limit"], f"{key}.limit", 1, 1_000_000_000)
    if "window" in m and "window" in needed:
        values["window"] = r.duration(m["window"], f"{key}.window")
    if "period" in m and "period" in optional:
        values["window"] = r.duration(m["period"], f"{key}.period")
    if "rate" in m and "rate" in needed:
        values["rate"] = r.typed(m["rate"], f"{key}.rate", "a rate", parse_rate)
    if "burst" in m and "burst" in needed:
        values["burst"] = r.integer(m["burst"], f"{key}.burst", 1, 1_000_000_000)
    if algorithm == "sliding_log" and (values.get("limit") or 0) > 100_000:
        message = "sliding_log keeps one entry per request; use at most 100000 (or sliding_window)"
        r.problem(m["limit"], f"{key}.limit", message)
    by: list[Source] = []
    if "by" in m:
        for j, snode in enumerate(r.sequence(m["by"], f"{key}.by") or []):
            source = _source(snode, f"{key}.by[{j}]", r, params, jwt)
            if source is not None:
                by.append(source)
    else:
        r.problem(node, f"{key}.by", "is required ([] for one shared key)")
    if "cost" in m:
        cost_text = r.string(m["cost"], f"{key}.cost") or ""
        if cost_text.startswith("header:"):
            header = cost_text[len("header:"):].strip().lower()
            if header in UNREADABLE_HEADERS:
                r.problem(m["cost"], f"{key}.cost", UNREADABLE_HEADERS[header])
            if not re.match(r"^[a-z0-9-]{1,64}$", header):
                r.problem(m["cost"], f"{key}.cost", f"{cost_text!r} names no valid header")
            values["cost_header"] = header
        else:
            try:
                cost = int(cost_text)
                if not 1 <= cost <= MAX_COST:
                    raise ValueError
                values["cost"] = cost
            except ValueError:
                r.problem(m["cost"], f"{key}.cost", f"{cost_text!r} must be a whole number >= 1 or header:NAME")
    if "status" in m:
        values["status"] = r.integer(m["status"], f"{key}.status", 400, 599)
    if "shadow" in m:
        values["shadow"] = r.boolean(m["shadow"], f"{key}.shadow")
    if "on_missing" in m:
        values["on_missing"] = r.choice(m["on_missing"], f"{key}.on_missing", ON_MISSING)
    if any(v is None for v in values.values()) or any(p not in m for p in needed):
        return None
    rule = Rule(name=name, by=tuple(by), algorithm=algorithm, **values)
    if rule.window and not MIN_WINDOW <= rule.window <= MAX_SPAN:
        field = "period" if rule.algorithm == "quota" else "window"
        r.problem(m.get(field), f"{key}.{field}", "must be from 1ms to 100 years")
    if rule.algorithm in BUCKET_ALGORITHMS and rule.burst / rule.rate > MAX_SPAN:
        r.problem(m.get("rate"), f"{key}.rate", "refills the burst too slowly: burst / rate must be at most 100 years")
    if rule.cost > rule.capacity:
        message = f"cost {rule.cost} can never fit: the rule holds at most {rule.capacity}"
        r.problem(m.get("cost"), f"{key}.cost", message)
    return rule


def _source(
    node: yaml.Node, key: str, r: _Reader, params: list[str], jwt: JwtSettings
) -> Source | None:
    text = r.string(node, key)
    if text is None:
        return None
    kind, _, name = text.partition(":")
    kind = kind.strip()
    name = name.strip()
    if kind not in SOURCE_KINDS:
        known = "ip, method, body, header:NAME, query:NAME, path:PARAM, cookie:NAME, jwt:CLAIM"
        r.problem(node, key, f"{text!r} is not an identity source (one of: {known})")
        return None
    if kind in ("ip", "method", "body"):
        if name:
            r.problem(node, key, f"{kind} takes no name")
            return None
        return Source(kind)
    if not name or len(name) > 128:
        r.problem(node, key, f"{kind} needs a name, as in {kind}:NAME")
        return None
    if kind == "path" and name not in params:
        has = ", ".join(params) or "none"
        r.problem(node, key, f"path parameter {name!r} is not in the route's path (it has: {has})")
        return None
    if kind == "jwt" and not jwt.algorithms:
        r.problem(node, key, "jwt identities need a top-level jwt: section with a key to verify tokens")
        return None
    if kind == "header":
        name = name.lower()
        if name in UNREADABLE_HEADERS:
            r.problem(node, key, UNREADABLE_HEADERS[name])
            return None
    return Source(kind, name)


# Fields no identity can read: hop-by-hop or framing (the gateway removes or rewrites them before
# identities are read, so the limit and the upstream never see them as sent).
_HOP = "is hop-by-hop: removed before identities are read, never forwarded"
UNREADABLE_HEADERS = {
    **{name.decode(): f"header {name.decode()} {_HOP}" for name in sorted(HOP_BY_HOP)},
    "content-length": "header content-length is framing the gateway writes itself; it is not an identity",
    "expect": "header expect is handled by the gateway and never forwarded",
    "x-forwarded-proto": "header x-forwarded-proto is written by the gateway; the client's is dropped",
    "x-forwarded-host": "header x-forwarded-host is written by the gateway; use header:host (the client's Host)",
}
