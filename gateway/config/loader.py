"""routes.yaml -> validated, frozen objects (model.py), driven by the field table (fields.py).

Every mapping is checked against its place's allow-list and every scalar typed by its field's kind;
what the table cannot say (an upstream or path parameter that does not exist, a cost that can never
fit, a shard's share) is checked below. Every problem names the file, the line and the key, and all
problems are reported together. `${NAME}` and `${NAME:-default}` are replaced from the environment
before a value is typed.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gateway.calendars import NOMINAL, Period
from gateway.config import rls
from gateway.config.fields import (
    BUCKET_ALGORITHMS,
    MAX_COST,
    MAX_RULES,
    MAX_SPAN,
    MIN_WINDOW,
    SLIDING_LOG_MAX,
    Algorithm,
    Place,
    default,
    fields,
    keys,
    parameters,
)
from gateway.config.kinds import (
    ENV_REF,
    NAMELESS_SOURCES,
    PARAM,
    SOURCE_KINDS,
    TRUE,
    TYPED_SOURCES,
    Kind,
    ListOf,
    Name,
    Scalar,
    is_typed,
)
from gateway.config.model import (
    Conditions,
    Config,
    JwtSettings,
    KeysSettings,
    Priority,
    Protect,
    RedisSettings,
    RlsDomain,
    Route,
    Rule,
    Source,
    Upstream,
    UpstreamTls,
    keeps_full_limit,
    shard_share,
)
from gateway.errors import ConfigError, ConfigProblem
from gateway.hop_by_hop import HOP_BY_HOP
from gateway.typed_values import TYPES

Params = Mapping[str, str | None]  # a route's path parameters and the type its template gives each

MAX_FILE_BYTES = 4 * 1024 * 1024
# RFC 9110's methods, PATCH (RFC 5789), WebDAV's (RFC 4918, 3253, 5323) and the common cache purge
KNOWN_METHODS = frozenset({
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY",
    "PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "REPORT", "SEARCH", "MKCALENDAR",
    "PURGE",
})
MAX_NODES = 200_000
MAX_DEPTH = 40

T = TypeVar("T")


@dataclass
class Found:
    """One mapping of the file, its keys checked against its place: the value node of each key, and
    the keys whose values could not be typed."""

    node: yaml.Node
    nodes: dict[str, yaml.Node]
    missing: set[str] = field(default_factory=set)
    bad: set[str] = field(default_factory=set)

    def __contains__(self, key: str) -> bool:
        return key in self.nodes


class _Reader:
    """Walks the YAML node tree, typing values and collecting problems with their lines."""

    def __init__(self, file: str, env: Mapping[str, str], proxy: bool = True, decision_only: bool = False) -> None:
        self.proxy = proxy  # False: rules guarding an app in-process (routes need no upstream)
        self.decision_only = decision_only  # the check port is on: every rule must be decidable there
        self.file = file
        self.env = env
        self.problems: list[ConfigProblem] = []
        self.warnings: list[ConfigProblem] = []  # what `gateway check` prints and still accepts
        self.shared: dict[str, Rule] = {}  # the file's `shared:` rules, read before its routes
        self.plans: frozenset[str] | None = None  # the plans a `match: {plan: }` may name (None: no keys:)
        self.keys_source: Source | None = None  # `keys.source`, read before every rule: a secret source

    def problem(self, node: yaml.Node | None, key: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.problems.append(ConfigProblem(self.file, line, key, message))

    def warn(self, node: yaml.Node | None, key: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.warnings.append(ConfigProblem(self.file, line, key, message))

    def mapping(self, node: yaml.Node, key: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node] | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, key or "(document)", "must be a mapping")
            return None
        out: dict[str, yaml.Node] = {}
        for knode, vnode in node.value:
            name = knode.value if isinstance(knode, yaml.ScalarNode) else None
            shown = name if name else "(empty key)" if name == "" else "(non-text key)"
            path = _join(key, shown)
            if name not in allowed:
                hint = ", ".join(allowed)
                self.problem(knode, path, f"unknown key (allowed here: {hint})")
            elif name in out:
                self.problem(knode, path, "appears twice")
            else:
                out[name] = vnode
        return out

    def section(self, node: yaml.Node, key: str, place: Place, require: bool = True) -> Found | None:
        """The mapping at `node`, its keys those of `place`; unless told not to, each required key that
        is absent is a problem (see `require`)."""
        nodes = self.mapping(node, key, keys(place))
        if nodes is None:
            return None
        found = Found(node, nodes)
        if require:
            self.require(found, key, place)
        return found

    def require(self, found: Found, key: str, place: Place, only: Iterable[str] | None = None) -> bool:
        """Whether every required key of `place` (or of those in `only`) is in `found`; a problem for each
        that is not."""
        for f in fields(place):
            if f.required is None or f.key in found or (only is not None and f.key not in only):
                continue
            if self.proxy or not f.proxy_only:
                self.problem(found.node, _join(key, f.key), f"is required {f.required}".rstrip())
                found.missing.add(f.key)
        return not found.missing

    def read(self, found: Found, key: str, place: Place, only: Iterable[str] | None = None,
             skip: Iterable[str] = ()) -> dict[str, Any]:
        """The typed values of `place`'s scalar keys present in `found` (those in `only`, but not in
        `skip`), by the model's attribute names. A value that cannot be typed is a problem, and its key
        is in found.bad."""
        wanted, unwanted = None if only is None else set(only), set(skip)
        out: dict[str, Any] = {}
        for f in fields(place):
            if f.key not in found or f.key in unwanted or (wanted is not None and f.key not in wanted):
                continue
            if not is_typed(f.kind):
                continue
            value = self.value(found.nodes[f.key], _join(key, f.key), f.kind)
            if value is None:
                found.bad.add(f.key)
            else:
                out[f.name] = value
        return out

    def value(self, node: yaml.Node, key: str, kind: Kind) -> Any:
        """The value at `node` typed by `kind` (see kinds.is_typed), or None after a problem."""
        if isinstance(kind, Scalar):
            return self.typed(node, key, kind.noun, kind.parse)
        assert isinstance(kind, ListOf), kind
        assert isinstance(kind.item, Scalar), kind
        if kind.single and isinstance(node, yaml.ScalarNode):
            one = self.typed(node, key, kind.item.noun, kind.item.parse)
            return None if one is None else (one,)
        items = self.sequence(node, key)
        if items is None:
            return None
        values = (self.typed(item, f"{key}[{j}]", kind.item.noun, kind.item.parse) for j, item in enumerate(items))
        return tuple(v for v in values if v is not None)

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

    def typed(self, node: yaml.Node, key: str, noun: str, parse: Callable[[str], T]) -> T | None:
        text = self.text(node, key)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError as exc:
            self.problem(node, key, f"must be {noun}: {exc}" if noun else str(exc))
            return None


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


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


def load_config(path: str | Path, env: Mapping[str, str] | None = None, proxy: bool = True,
                decision_only: bool = False) -> Config:
    """Read and validate one routes.yaml. Raises ConfigError listing every problem.

    proxy=False: for the in-process middleware, where routes need no upstream.
    decision_only=True: the check port is on, where no rule may need the upstream's
    answer or the request's body."""
    file = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError([ConfigProblem(file, 0, "(file)", f"cannot read: {exc.strerror}")]) from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([ConfigProblem(file, 0, "(file)", "larger than 4 MiB")])
    return parse_config(data, file, os.environ if env is None else env, proxy, decision_only)


def parse_config(data: bytes | str, file: str, env: Mapping[str, str], proxy: bool = True,
                 decision_only: bool = False) -> Config:
    reader = _Reader(file, env, proxy, decision_only)
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
    return replace(config, warnings=tuple(reader.warnings)) if reader.warnings else config


def _build(root: yaml.Node, r: _Reader) -> Config | None:
    top = r.section(root, "", Place.TOP, require=False)
    if top is None:
        return None
    if "check" in top:  # a file written for the check port is read as with the port on
        r.decision_only = True
    # a rate limit service alone (rls:) needs no route and no upstream: Envoy does the forwarding;
    # with the check port on, the proxy in front does
    optional = ("routes", "upstreams") if "rls" in top else ("upstreams",) if r.decision_only else ()
    r.require(top, "", Place.TOP, only=[k for k in keys(Place.TOP) if k not in optional])
    settings = r.read(top, "", Place.TOP)  # version, trusted_proxies, access_log
    settings.pop("version", None)
    settings.setdefault("trusted_proxies", default(Place.TOP, "trusted_proxies"))  # a Config field without default
    redis = _redis(top, r)
    defaults = {f.key: f.default for f in fields(Place.DEFAULTS)}
    if "defaults" in top:
        found = r.section(top.nodes["defaults"], "defaults", Place.DEFAULTS)
        defaults.update(r.read(found, "defaults", Place.DEFAULTS) if found else {})
    jwt = _jwt(top.nodes["jwt"], r) if "jwt" in top else JwtSettings()
    for place in (Place.ADMIN, Place.IDENTITY, Place.LOCAL_REFUSALS, Place.CHECK):  # Config's own keys (Field.attr)
        if place.value in top:
            found = r.section(top.nodes[place.value], place.value, place)
            settings.update(r.read(found, place.value, place) if found else {})
    if "admin_token" in settings:
        settings["admin_token"] = settings["admin_token"] or None
    settings.pop("shared", None)
    keys_settings = _keys(top.nodes["keys"], r, jwt) if "keys" in top else None
    if keys_settings is not None:
        r.plans = frozenset(keys_settings.plans) | ({"none"} if keys_settings.unknown == "pass" else set())
    r.keys_source = keys_settings.source if keys_settings is not None else None
    upstreams = _upstreams(top, r, jwt)
    if "shared" in top:
        r.shared = _shared(top.nodes["shared"], r, jwt)
    routes = _routes(top, r, upstreams, defaults, jwt)
    _check_plans(top, routes, keys_settings, r)
    rls_files: list[str] = []
    rls = _rls(top.nodes["rls"], r, defaults, {route.name for route in routes}, rls_files) if "rls" in top else ()
    if r.problems:
        return None
    return Config(source=r.file, redis=redis, upstreams=upstreams, routes=routes, jwt=jwt, rls=rls,
                  rls_files=tuple(rls_files), keys=keys_settings, **settings)


def _rls(node: yaml.Node, r: _Reader, defaults: dict[str, str], route_names: set[str],
         files: list[str]) -> tuple[RlsDomain, ...]:
    """`rls:` envoyproxy/ratelimit's files (rls.files, relative to this file; each path read is
    added to `files`) and the native domains."""
    found = r.section(node, "rls", Place.RLS)
    if found is None:
        return ()
    sources: list[tuple[rls.DomainSource, yaml.Node]] = []
    base = Path(r.file).parent
    for i, path in enumerate(r.read(found, "rls", Place.RLS, only=["files"]).get("files", ())):
        where = found.nodes["files"].value[i]
        if not path:
            r.problem(where, f"rls.files[{i}]", "must be a path")
            continue
        shown = str(base / path) if not Path(path).is_absolute() else path
        files.append(shown)
        source, problems = rls.read_file(base / path, shown)
        r.problems.extend(problems)
        if source is not None:
            sources.append((source, where))
    if "domains" in found:
        sources.extend(_rls_native(found.nodes["domains"], r))
    out: list[RlsDomain] = []
    seen: dict[str, str] = {}
    route_fields = {"headers": defaults["headers"]}
    for source, where in sources:
        if source.name in seen:
            r.problem(where, f"rls domain {source.name}",
                      f"duplicate domain '{source.name}' (also in {seen[source.name]})")
            continue
        seen[source.name] = f"{source.file}:{source.line}"
        if f"rls.{source.name}" in route_names:
            r.problem(where, f"rls domain {source.name}",
                      f"a route is named 'rls.{source.name}', the domain's own name")
            continue
        domain, problems = rls.assemble(source, {**route_fields, "shards": source.shards})
        r.problems.extend(problems)
        if domain is not None:
            out.append(domain)
    return tuple(out)


def _rls_native(node: yaml.Node, r: _Reader) -> list[tuple[rls.DomainSource, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        r.problem(node, "rls.domains", "must be a mapping of domain -> its descriptors")
        return []
    out = []
    for knode, vnode in node.value:
        name = r.text(knode, "rls.domains")
        if name is None:
            continue
        key = f"rls.domains.{name}"
        if not rls.DOMAIN.match(name):
            r.problem(knode, key, "a domain is 1 to 56 of A-Z a-z 0-9 _ . - (it names the domain's keys and metrics)")
            continue
        found = r.section(vnode, key, Place.RLS_DOMAIN)
        if found is None or found.missing:
            continue
        shards = r.read(found, key, Place.RLS_DOMAIN, only=["shards"]).get("shards", 1)
        nodes = _rls_descriptors(found.nodes["descriptors"], f"{key}.descriptors", r, 1)
        if shards > 1:
            _check_rls_shards(nodes, found.nodes["shards"], key, r, shards)
        out.append((rls.DomainSource(name, r.file, vnode.start_mark.line + 1, nodes, shards), knode))
    return out


def _check_rls_shards(nodes: list[rls.Node], snode: yaml.Node, key: str, r: _Reader, shards: int) -> None:
    """Every rule of a sharded domain may hold only its share in a shard: each share at least 1."""
    for node in nodes:
        rule = node.rule
        if rule is not None and rule.quota_size < shards:
            size = "burst" if rule.algorithm in BUCKET_ALGORITHMS else "limit"
            r.problem(snode, f"{key}.shards", f"rule {rule.name!r} ({size} {rule.quota_size}) cannot be split over "
                                              f"{shards} shards: where it is not a call's first descriptor it holds "
                                              "a share in each shard, and each needs at least 1")
        _check_rls_shards(node.children, snode, key, r, shards)


def _rls_descriptors(node: yaml.Node, key: str, r: _Reader, depth: int) -> list[rls.Node]:
    if depth > rls.MAX_DEPTH:
        r.problem(node, key, f"descriptors nest deeper than {rls.MAX_DEPTH}")
        return []
    out: list[rls.Node] = []
    seen: set[tuple[str, str]] = set()
    for i, item in enumerate(r.sequence(node, key) or []):
        here = f"{key}[{i}]"
        found = r.section(item, here, Place.RLS_DESCRIPTOR)
        if found is None or found.missing:
            continue
        values = r.read(found, here, Place.RLS_DESCRIPTOR)
        entry = rls.Node(values.get("key", ""), values.get("value", ""), item.start_mark.line + 1,
                         unlimited=values.get("unlimited", False), replaces=tuple(values.get("replaces", ())))
        if (entry.key, entry.value) in seen:
            r.problem(item, here, f"entry {entry.key}={entry.value or '*'} is defined twice at this level")
        seen.add((entry.key, entry.value))
        if "limit" in found:
            if entry.unlimited:
                r.problem(found.nodes["limit"], f"{here}.limit", "an unlimited descriptor has no limit")
            rule = _rule(found.nodes["limit"], f"{here}.limit", r, {}, JwtSettings(), keyed=False)
            if rule is not None:
                if rule.by:
                    r.problem(_child(found.nodes["limit"], "by"), f"{here}.limit.by",
                              "a descriptor's rule counts by the descriptor's values: leave out `by`")
                for unseen in (k for k in rule.unseen_by_a_check if k != "by"):
                    r.problem(_child(found.nodes["limit"], unseen) or item, f"{here}.limit.{unseen}",
                              "needs the upstream's answer, which the rate limit service never sees")
                if rule.algorithm == Algorithm.LEAKY_BUCKET:
                    r.problem(_child(found.nodes["limit"], "algorithm") or item, f"{here}.limit.algorithm",
                              "leaky_bucket admits a request after a delay, and Envoy cannot be told to wait "
                              "(its rate limit call times out, 20ms by default): use gcra or token_bucket, "
                              "which refuse at once")
                entry.rule, entry.limit_name = rule, rule.name
        if "descriptors" in found:
            entry.children = _rls_descriptors(found.nodes["descriptors"], f"{here}.descriptors", r, depth + 1)
        out.append(entry)
    return out


def _calendar(found: Found, key: str, r: _Reader, algorithm: Algorithm, values: dict[str, Any]) -> None:
    """A `window:` or `period:` of day, week or month (gateway/calendars.py), and its `calendar:`."""
    span = "period" if algorithm == Algorithm.QUOTA else "window"
    period = values.get("window")
    if isinstance(period, Period):
        if algorithm not in (Algorithm.FIXED_WINDOW, Algorithm.QUOTA):
            r.problem(found.nodes[span], f"{key}.{span}", f"{period} is a calendar period: fixed_window and quota "
                                                          f"take one, {algorithm} takes a duration")
            found.bad.add(span)
            return
        values["window"], values["calendar_period"] = float(NOMINAL[period]), str(period)
    elif "calendar" in values:
        r.problem(found.nodes["calendar"], f"{key}.calendar",
                  f"goes with a {span} of day, week or month (a duration's windows are not local)")


def _redis(top: Found, r: _Reader) -> RedisSettings:
    found = r.section(top.nodes["redis"], "redis", Place.REDIS) if "redis" in top else None
    return RedisSettings(**r.read(found, "redis", Place.REDIS)) if found else RedisSettings()


def _jwt(node: yaml.Node, r: _Reader) -> JwtSettings:
    found = r.section(node, "jwt", Place.JWT)
    if found is None:
        return JwtSettings()
    values = r.read(found, "jwt", Place.JWT)
    algorithms: tuple[str, ...] = values.pop("algorithms", ())
    file = values.pop("public_key_file", None)
    if file:
        try:
            values["public_key"] = Path(file).read_text()
        except OSError as exc:
            r.problem(found.nodes["public_key_file"], "jwt.public_key_file", f"cannot read: {exc.strerror}")
    secret, public_key = values.get("secret"), values.get("public_key")
    if not algorithms:
        algorithms = ("HS256",) if secret else ("RS256",)
    if any(a.startswith("HS") for a in algorithms) and not secret:
        r.problem(node, "jwt.secret", "is required for HS* algorithms")
    if any(not a.startswith("HS") for a in algorithms) and not public_key:
        r.problem(node, "jwt.public_key", "is required for RS*/ES* algorithms")
    values.update(algorithms=algorithms, secret=secret or None, public_key=public_key or None)
    if "header" in values:
        values["header"] = (values["header"] or "authorization").lower()
    return JwtSettings(**values)


def _upstreams(top: Found, r: _Reader, jwt: JwtSettings) -> dict[str, Upstream]:
    if "upstreams" not in top:
        return {}
    node = top.nodes["upstreams"]
    if not isinstance(node, yaml.MappingNode):
        r.problem(node, "upstreams", "must be a mapping of name -> upstream")
        return {}
    out: dict[str, Upstream] = {}
    for knode, vnode in node.value:
        name = r.value(knode, "upstreams", Name())
        if name is None:
            continue
        key = f"upstreams.{name}"
        found = r.section(vnode, key, Place.UPSTREAM)
        if found is None or found.missing:
            continue
        values = r.read(found, key, Place.UPSTREAM)
        url: str = values.pop("url", "")  # absent when refused: the problem is reported, the name still known
        if values.get("http2") and "url" not in found.bad and not url.startswith("https://"):
            r.problem(found.nodes["http2"], f"{key}.http2", "HTTP/2 to an upstream needs an https:// url (ALPN)")
        if "tls" in found:
            values["tls"] = _tls(found.nodes["tls"], f"{key}.tls", r)
            if "url" not in found.bad and not url.startswith("https://"):
                r.problem(found.nodes["tls"], f"{key}.tls", "tls settings need an https:// url")
        if "protect" in found:
            values["protect"] = _protect(found.nodes["protect"], f"{key}.protect", r, jwt)
        out[name] = Upstream(name=name, url=url.rstrip("/"), **values)
    return out


def _tls(node: yaml.Node, key: str, r: _Reader) -> UpstreamTls | None:
    found = r.section(node, key, Place.TLS)
    if found is None:
        return None
    values = r.read(found, key, Place.TLS)
    for name in ("ca", "cert", "key"):
        path = values.get(name)
        if path and not os.path.isfile(path):
            r.problem(found.nodes[name], f"{key}.{name}", f"no such file: {path}")
    if ("cert" in values) != ("key" in values):
        r.problem(node, key, "cert and key go together (a client certificate and its private key)")
    return UpstreamTls(**values)


def _keys(node: yaml.Node, r: _Reader, jwt: JwtSettings) -> KeysSettings | None:
    """`keys:` API keys and plans at runtime (gateway/api_keys.py)."""
    found = r.section(node, "keys", Place.KEYS)
    if found is None or found.missing:
        return None
    values = r.read(found, "keys", Place.KEYS, skip=["source"])
    source = _source(found.nodes["source"], "keys.source", r, {}, jwt)
    plans = values.get("plans", ())
    if not plans:
        r.problem(found.nodes["plans"], "keys.plans", "must name at least one plan")
    elif len(plans) > 255:
        r.problem(found.nodes["plans"], "keys.plans", "at most 255 plans")
    elif "none" in plans:
        r.problem(found.nodes["plans"], "keys.plans", "`none` is the plan of an unknown key (unknown: pass)")
    elif len(set(plans)) != len(plans):
        r.problem(found.nodes["plans"], "keys.plans", "names a plan twice")
    if source is None or found.bad or r.problems:
        return None
    return KeysSettings(source, values.get("unknown", "reject"), tuple(plans))


def _check_plans(top: Found, routes: tuple[Route, ...], keys_settings: KeysSettings | None, r: _Reader) -> None:
    """A route's `match.plan` names plans of `keys:` (`none` with unknown: pass)."""
    known = set(keys_settings.plans) if keys_settings else set()
    if keys_settings is not None and keys_settings.unknown == "pass":
        known.add("none")
    items = top.nodes["routes"].value if "routes" in top and isinstance(top.nodes["routes"], yaml.SequenceNode) else []
    for i, item in enumerate(items):
        name = _child(item, "name")
        route = next((x for x in routes if name is not None and x.name == name.value), None)
        if route is None or not route.when.plans - known:
            continue
        node = _child(_child(item, "match") or item, "plan") or item
        where = f"routes[{i}]({route.name}).match.plan"
        if keys_settings is None and "keys" not in top:
            r.problem(node, where, "matching on a plan needs a top-level keys: section")
            continue
        for plan in sorted(route.when.plans - known):
            near = difflib.get_close_matches(plan, sorted(known), n=1)
            r.problem(node, where, f"no plan named {plan!r} in keys.plans" +
                      (f" (did you mean {near[0]}?)" if near else f" (plans: {', '.join(sorted(known))})"))


def _shared(node: yaml.Node, r: _Reader, jwt: JwtSettings) -> dict[str, Rule]:
    """`shared:` rules several routes name ({use: NAME}): one counter wherever used."""
    out: dict[str, Rule] = {}
    for i, item in enumerate(r.sequence(node, "shared") or []):
        if i == MAX_RULES:
            r.problem(item, f"shared[{i}]", f"at most {MAX_RULES} shared rules")
        rule = _rule(item, f"shared[{i}]", r, {}, jwt)
        if rule is None:
            continue
        where = f"shared[{i}]({rule.name})"
        if rule.name in out:
            r.problem(item, f"{where}.name", f"shared rule '{rule.name}' is defined twice")
        if rule.settles or rule.algorithm == Algorithm.CONCURRENCY:
            r.problem(item, where, "a shared rule is counted at admission only: counting by the answer, "
                                   "refunds, token budgets and concurrency slots belong to one route's rules")
        out[rule.name] = replace(rule, shared=True)
    return out


def _use(node: yaml.Node, key: str, r: _Reader) -> Rule | None:
    """`{use: NAME}` in a route's limits: the shared rule NAME."""
    found = r.section(node, key, Place.USE)
    if found is None or found.missing:
        return None
    name = r.read(found, key, Place.USE).get("use")
    if name is None:
        return None
    rule = r.shared.get(name)
    if rule is None:
        near = difflib.get_close_matches(name, sorted(r.shared), n=1)
        known = f" (did you mean {near[0]}?)" if near else f" (shared: {', '.join(sorted(r.shared)) or 'none'})"
        r.problem(found.nodes["use"], f"{key}.use", f"no shared rule named {name!r}{known}")
    return rule


def _routes(
    top: Found, r: _Reader, upstreams: dict[str, Upstream], defaults: dict[str, str], jwt: JwtSettings
) -> tuple[Route, ...]:
    if "routes" not in top:
        return ()
    out: list[Route] = []
    names: set[str] = set()
    takes_all: tuple[str, int] | None = None  # a route before that takes every request: (name, line)
    placed: list[tuple[int, yaml.Node]] = []  # each route's index and node
    for i, item in enumerate(r.sequence(top.nodes["routes"], "routes") or []):
        route = _route(item, f"routes[{i}]", r, upstreams, defaults, jwt)
        if route is None:
            continue
        if route.name in names:
            r.problem(item, f"routes[{i}].name", f"route '{route.name}' is defined twice")
        if takes_all is not None:
            r.problem(item, f"routes[{i}]({route.name})", f"can never match: route '{takes_all[0]}' (line "
                      f"{takes_all[1]}) before it takes every request (routes are tried in file order; move "
                      "the catch-all last)")
        elif _takes_every_request(route):
            takes_all = (route.name, item.start_mark.line + 1)
        names.add(route.name)
        out.append(route)
        placed.append((i, item))
    for route, (i, item) in zip(out, placed, strict=True):  # usage_of names routes of this file
        for name in route.usage_of:
            if name not in names:
                near = difflib.get_close_matches(name, sorted(names), n=1)
                r.problem(_child(item, "usage_of"), f"routes[{i}]({route.name}).usage_of",
                          f"no route named {name!r}" + (f" (did you mean {near[0]}?)" if near else ""))
    return tuple(out)


def _takes_every_request(route: Route) -> bool:
    """A route whose template matches any path, for any method and host, whoever asks."""
    return (re.fullmatch(r"/\{[A-Za-z_][A-Za-z0-9_]*:path\}", route.path) is not None and route.methods is None
            and route.host is None and not route.when)


def _route(
    node: yaml.Node, key: str, r: _Reader, upstreams: dict[str, Upstream], defaults: dict[str, str],
    jwt: JwtSettings,
) -> Route | None:
    found = r.section(node, key, Place.ROUTE, require=False)
    if found is None:
        return None
    answers_itself = "respond" in found  # no upstream: the gateway answers (respond: usage)
    no_upstream = answers_itself or r.decision_only  # ... or the route is decided on the check port
    r.require(found, key, Place.ROUTE, only=[k for k in keys(Place.ROUTE) if not (no_upstream and k == "upstream")])
    if found.missing:
        return None
    name = r.read(found, key, Place.ROUTE, only=["name"]).get("name")
    key = f"{key}({name})" if name else key
    values = {**defaults, **r.read(found, key, Place.ROUTE, skip=["name"])}
    path, methods, host, when, path_case = _match(found.nodes["match"], f"{key}.match", r, jwt)
    if "usage_of" in values:
        values["usage_of"] = tuple(values["usage_of"])
        if not answers_itself:
            r.problem(found.nodes["usage_of"], f"{key}.usage_of", "only a respond: usage route reports usage")
    if answers_itself and "upstream" in found:
        r.problem(found.nodes["upstream"], f"{key}.upstream", "a respond: usage route answers itself: it has no "
                                                              "upstream")
    upstream_name: str | None = values.pop("upstream", None)
    upstream = upstreams.get(upstream_name or "")
    if upstream is None and upstream_name is not None:
        known = ", ".join(sorted(upstreams)) or "none defined"
        r.problem(found.nodes["upstream"], f"{key}.upstream", f"no upstream named {upstream_name!r} (known: {known})")
    rules, rule_nodes = _rules(found, key, r, {m.group(1): m.group(2) for m in PARAM.finditer(path)}, jwt)
    if values.get("shards", 1) > 1:
        _check_shards(found.nodes["shards"], key, r, rules, rule_nodes, values["shards"])
        if any(rule.shared for rule in rules):
            r.problem(found.nodes["shards"], f"{key}.shards", "a route that uses a shared rule keeps its keys "
                                                              "with that rule's, in one hash tag: it cannot be sharded")
    if "protect" in found:
        values["protect"] = _protect(found.nodes["protect"], f"{key}.protect", r, jwt)
        if upstream is None and r.proxy:
            r.problem(found.nodes["protect"], f"{key}.protect", "protect limits the requests in flight to an "
                                                                "upstream: this route has none")
    if values.get("websocket") and upstream is not None and upstream.http2:
        r.problem(found.nodes["websocket"], f"{key}.websocket",
                  f"upstream {upstream.name!r} speaks HTTP/2, which has no Upgrade: a WebSocket route needs HTTP/1.1")
    if name is None or (upstream is None and r.proxy and not no_upstream):
        return None
    return Route(name=name, path=path, methods=methods, host=host, upstream=upstream, limits=tuple(rules),
                 when=when, path_case=path_case, **values)


def _match(node: yaml.Node, key: str, r: _Reader,
           jwt: JwtSettings) -> tuple[str, frozenset[str] | None, str | None, Conditions, str]:
    found = r.section(node, key, Place.MATCH)
    if found is None:
        return "/", None, None, Conditions(), "sensitive"
    values = r.read(found, key, Place.MATCH)
    methods = _methods(found, key, r, values)
    when = _when(found, key, r, jwt, values)
    return values.get("path") or "/", methods, values.get("host", "").lower() or None, when, values.get(
        "path_case", "sensitive")


def _methods(found: Found, key: str, r: _Reader, values: dict[str, Any]) -> frozenset[str] | None:
    methods = frozenset(m.upper() for m in values["methods"]) if "methods" in values else None
    for method in sorted(methods or ()):
        if method not in KNOWN_METHODS:
            near = difflib.get_close_matches(method, sorted(KNOWN_METHODS), n=1)
            r.problem(found.nodes["methods"], f"{key}.methods",
                      f"{method} is no HTTP method" + (f" (did you mean {near[0]}?)" if near else ""))
    return methods


def _when(found: Found, key: str, r: _Reader, jwt: JwtSettings, values: dict[str, Any]) -> Conditions:
    """`match: headers, jwt, client, plan` of a route or a priority."""
    headers: list[tuple[bytes, frozenset[bytes] | None]] = []
    for name, wanted, name_node in _conditions(found, "headers", key, r, presence=True):
        name = name.lower()
        if name in UNREADABLE_HEADERS or not re.match(r"^[a-z0-9_-]{1,64}$", name):
            r.problem(name_node, f"{key}.headers.{name}", UNREADABLE_HEADERS.get(name, f"{name!r} is no header name"))
            continue
        headers.append((name.encode(), None if wanted is None else frozenset(v.encode() for v in wanted)))
    claims = [(name, frozenset(wanted or ())) for name, wanted, _ in _conditions(found, "jwt", key, r)]
    if claims and not jwt.algorithms:
        r.problem(found.nodes["jwt"], f"{key}.jwt", "matching on JWT claims needs a top-level jwt: section "
                                                    "with a key to verify tokens")
    return Conditions(tuple(headers), tuple(claims), tuple(values.get("client", ())),
                      frozenset(values.get("plan", ())))


def _conditions(found: Found, place: str, key: str, r: _Reader,
                presence: bool = False) -> list[tuple[str, tuple[str, ...] | None, yaml.Node]]:
    """`match.headers` or `match.jwt`: (name, the values it may have or None for any, its node)."""
    if place not in found:
        return []
    node = found.nodes[place]
    if not isinstance(node, yaml.MappingNode) or not node.value:
        r.problem(node, f"{key}.{place}", "must be a mapping of name to value, [values]" +
                  (" or true" if presence else ""))
        return []
    out: list[tuple[str, tuple[str, ...] | None, yaml.Node]] = []
    for name_node, value_node in node.value:
        name = r.text(name_node, f"{key}.{place}")
        if not name:
            continue
        where = f"{key}.{place}.{name}"
        if isinstance(value_node, yaml.SequenceNode):
            items = [r.text(item, where) for item in value_node.value]
            if not items or any(item is None for item in items):
                r.problem(value_node, where, "must list at least one value")
                continue
            out.append((name, tuple(item.strip() for item in items if item is not None), name_node))
            continue
        text = r.text(value_node, where)
        if text is None:
            continue
        if presence and value_node.tag == "tag:yaml.org,2002:bool" and text.lower() in TRUE:
            out.append((name, None, name_node))
        elif value_node.tag == "tag:yaml.org,2002:bool":
            r.problem(value_node, where, "must be a value or [values]" + (" (true: present)" if presence else ""))
        else:
            out.append((name, (text.strip(),), name_node))
    return out


def _protect(node: yaml.Node, key: str, r: _Reader, jwt: JwtSettings) -> Protect | None:
    found = r.section(node, key, Place.PROTECT)
    if found is None:
        return None
    values = r.read(found, key, Place.PROTECT)
    if "latency" in found:
        latency = r.section(found.nodes["latency"], f"{key}.latency", Place.LATENCY)
        if latency is not None:
            values.update(r.read(latency, f"{key}.latency", Place.LATENCY))
            if latency.bad:
                return None
    if values.get("min_limit", 1) > values.get("max_limit", 100_000):
        r.problem(found.nodes["min_limit"], f"{key}.min_limit", "must not exceed max_limit")
    priorities = _priorities(found.nodes["priorities"], f"{key}.priorities", r, jwt) if "priorities" in found else (
        Priority("default", 1.0),)
    if values.get("scope") == "fleet":
        for i, priority in enumerate(priorities):
            if priority.queue_size:
                r.problem(found.nodes["scope"], f"{key}.priorities[{i}].queue", "a queue needs scope: worker (a "
                          "fleet's places are freed in other gateways, which cannot wake this one's waiters)")
    if found.bad or not priorities:
        return None
    return Protect(priorities, **values)


def _priorities(node: yaml.Node, key: str, r: _Reader, jwt: JwtSettings) -> tuple[Priority, ...]:
    items = r.sequence(node, key) or []
    if not items:
        r.problem(node, key, "must list at least one priority (the last takes every request)")
    out: list[Priority] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        found = r.section(item, where, Place.PRIORITY)
        if found is None or found.missing:
            continue
        values = r.read(found, where, Place.PRIORITY)
        name = values.get("name", "")
        if any(p.name == name for p in out):
            r.problem(found.nodes["name"], f"{where}.name", f"priority '{name}' is listed twice")
        when, methods = Conditions(), None
        if "match" in found:
            if i == len(items) - 1:
                r.problem(found.nodes["match"], f"{where}.match", "the last priority takes every request left: "
                                                                   "it matches nothing itself")
            match = r.section(found.nodes["match"], f"{where}.match", Place.PRIORITY_MATCH)
            if match is not None:
                conditions = r.read(match, f"{where}.match", Place.PRIORITY_MATCH)
                methods = _methods(match, f"{where}.match", r, conditions)
                when = _when(match, f"{where}.match", r, jwt, conditions)
                _check_priority_plans(match, f"{where}.match.plan", r, when.plans)
        share = values["share"] / 100 if "share" in values else 1 - 0.5 * i / max(1, len(items) - 1)
        if out and share > out[-1].share:
            r.problem(found.nodes.get("share", item), f"{where}.share", f"a priority may fill no more of the "
                      f"limit than the one before it ('{out[-1].name}', {round(out[-1].share * 100)}%): they "
                      "are listed from the most important to the least")
        queue = _queue(found, where, r)
        out.append(Priority(name, share, when, methods, *queue))
    return tuple(out)


def _queue(priority: Found, key: str, r: _Reader) -> tuple[int, float]:
    """A priority's queue: its size and timeout; (0, 0.0): none."""
    if "queue" not in priority:
        return 0, 0.0
    found = r.section(priority.nodes["queue"], f"{key}.queue", Place.QUEUE)
    if found is None:
        return 0, 0.0
    values = r.read(found, f"{key}.queue", Place.QUEUE)
    return values.get("size", 0), values.get("timeout", 1.0)


def _check_priority_plans(found: Found, key: str, r: _Reader, plans: frozenset[str]) -> None:
    if not plans:
        return
    if r.plans is None:
        r.problem(found.nodes["plan"], key, "matching on a plan needs a top-level keys: section")
        return
    for plan in sorted(plans - r.plans):
        near = difflib.get_close_matches(plan, sorted(r.plans), n=1)
        r.problem(found.nodes["plan"], key, f"no plan named {plan!r} in keys.plans" +
                  (f" (did you mean {near[0]}?)" if near else f" (plans: {', '.join(sorted(r.plans))})"))


def _rules(
    route: Found, key: str, r: _Reader, params: Params, jwt: JwtSettings
) -> tuple[list[Rule], list[yaml.Node]]:
    rules: list[Rule] = []
    nodes: list[yaml.Node] = []
    if "limits" not in route:
        return rules, nodes
    names: set[str] = set()
    for j, node in enumerate(r.sequence(route.nodes["limits"], f"{key}.limits") or []):
        if j == MAX_RULES:
            r.problem(node, f"{key}.limits[{j}]", f"a route holds at most {MAX_RULES} rules")
        uses = isinstance(node, yaml.MappingNode) and any(k.value == "use" for k, _ in node.value)
        rule = _use(node, f"{key}.limits[{j}]", r) if uses else _rule(node, f"{key}.limits[{j}]", r, params, jwt)
        if rule is None:
            continue
        if rule.name in names:
            r.problem(node, f"{key}.limits[{j}].name", f"rule '{rule.name}' is defined twice")
        if r.decision_only:
            for unseen in rule.unseen_by_a_check:
                r.problem(_child(node, unseen) or node, f"{key}.limits[{j}]({rule.name}).{unseen}",
                          "needs the upstream's answer or the request's body, which the check port "
                          "(--check-port) never sees: move the rule to a route the proxy port serves, or "
                          "drop it")
        names.add(rule.name)
        rules.append(rule)
        nodes.append(node)
    return rules, nodes


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
        size = "burst" if rule.algorithm in BUCKET_ALGORITHMS else "limit"
        node = _child(rnode, size) or rnode
        total = rule.quota_size
        if total < shards:
            r.problem(node, f"{where}.{size}",
                      f"{size} {total} is split over shards: {shards}; each shard needs at least 1 "
                      f"(use shards <= {total}, or give the rule the first rule's identity)")
            continue
        smallest = shard_share(total, shards, shards - 1) + (1 if rule.algorithm == Algorithm.LEAKY_BUCKET else 0)
        if rule.cost > smallest:
            r.problem(_child(rnode, "cost") or node, f"{where}.cost",
                      f"cost {rule.cost} can never fit a shard's share ({smallest} of {size} {total} "
                      f"over shards: {shards})")


def _child(node: yaml.Node, name: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            if isinstance(knode, yaml.ScalarNode) and knode.value == name:
                assert isinstance(vnode, yaml.Node)
                return vnode
    return None


def _rule(node: yaml.Node, key: str, r: _Reader, params: Params, jwt: JwtSettings,
          keyed: bool = True) -> Rule | None:
    """One rule; keyed=False: an RLS descriptor's, keyed by the descriptor's values (no `by`)."""
    found = r.section(node, key, Place.RULE, require=False)
    if found is None or not r.require(found, key, Place.RULE, only=["name", "algorithm"]):
        return None
    name = r.read(found, key, Place.RULE, only=["name"]).get("name")
    key = f"{key}({name})" if name else key
    r.require(found, key, Place.RULE, only=None if keyed else [k for k in keys(Place.RULE) if k != "by"])
    algorithm = r.read(found, key, Place.RULE, only=["algorithm"]).get("algorithm")
    if name is None or algorithm is None:
        # the rule's other keys are still checked: one run names every problem
        r.read(found, key, Place.RULE, skip=["name", "algorithm"])
        for j, snode in enumerate(r.sequence(found.nodes["by"], f"{key}.by") or [] if "by" in found else []):
            _source(snode, f"{key}.by[{j}]", r, params, jwt)
        if "cost" in found:
            _cost(found.nodes["cost"], f"{key}.cost", r)
        return None
    algorithm = Algorithm(algorithm)
    needed, optional = parameters(algorithm)
    takes = needed + optional
    for f in fields(Place.RULE):
        if f.is_parameter and f.key in found and f.key not in takes:
            r.problem(found.nodes[f.key], f"{key}.{f.key}",
                      f"is not a parameter of {algorithm} (it takes {', '.join(takes)})")
    for pkey in needed:
        if pkey not in found:
            r.problem(node, f"{key}.{pkey}", f"is required by {algorithm}")
    foreign = [f.key for f in fields(Place.RULE) if f.is_parameter and f.key not in takes]
    values = r.read(found, key, Place.RULE, skip=["name", "algorithm", *foreign])
    for statuses in ("count_on", "refund_on"):
        if statuses in values:
            values[statuses] = frozenset(status for covered in values[statuses] for status in covered)
    if algorithm == Algorithm.CONCURRENCY and values.get("limit", 0) > SLIDING_LOG_MAX:
        message = f"concurrency keeps one lease per request in flight; use at most {SLIDING_LOG_MAX}"
        r.problem(found.nodes["limit"], f"{key}.limit", message)
    if algorithm == Algorithm.SLIDING_LOG and values.get("limit", 0) > SLIDING_LOG_MAX:
        message = f"sliding_log keeps one entry per request; use at most {SLIDING_LOG_MAX} (or sliding_window)"
        r.problem(found.nodes["limit"], f"{key}.limit", message)
    by: list[Source] = []
    if "by" in found:
        for j, snode in enumerate(r.sequence(found.nodes["by"], f"{key}.by") or []):
            source = _source(snode, f"{key}.by[{j}]", r, params, jwt)
            if source is not None:
                by.append(source)
    if "cost" in found:
        values.update(_cost(found.nodes["cost"], f"{key}.cost", r))
    _calendar(found, key, r, algorithm, values)
    if found.bad or any(p not in found for p in needed):
        return None
    rule = Rule(name=name, by=tuple(by), algorithm=algorithm, **values)
    _warn_untyped_numbers(rule, found, key, r, params)
    if rule.window and not MIN_WINDOW <= rule.window <= MAX_SPAN:
        span = "period" if rule.algorithm == Algorithm.QUOTA else "window"
        r.problem(found.nodes.get(span), f"{key}.{span}", "must be from 1ms to 100 years")
    if rule.algorithm in BUCKET_ALGORITHMS and rule.burst / rule.rate > MAX_SPAN:
        r.problem(found.nodes.get("rate"), f"{key}.rate",
                  "refills the burst too slowly: burst / rate must be at most 100 years")
    if rule.cost > rule.capacity:
        message = f"cost {rule.cost} can never fit: the rule holds at most {rule.capacity}"
        r.problem(found.nodes.get("cost"), f"{key}.cost", message)
    if rule.settle_field is not None:
        _check_token_budget(rule, found, key, r)
    _check_settling(rule, found, key, r)
    return rule


def _check_settling(rule: Rule, found: Found, key: str, r: _Reader) -> None:
    """What counting by the answer cannot do (docs/algorithms.md, "Counting by the answer")."""
    after = "count_on" if rule.count_on else "cost" if rule.cost_response_header else None
    if after and rule.algorithm == Algorithm.LEAKY_BUCKET:
        r.problem(found.nodes[after], f"{key}.{after}", "a leaky_bucket places a request in its queue at "
                  "admission; it cannot be charged after the answer")
    if rule.algorithm == Algorithm.CONCURRENCY:
        for name in ("count_on", "refund_on"):
            if name in found:
                r.problem(found.nodes[name], f"{key}.{name}", "a concurrency slot is always given back when the "
                          "request ends; it is never charged or refunded by the answer")
        if rule.cost_response_header or rule.cost_header:
            r.problem(found.nodes["cost"], f"{key}.cost", "a concurrency rule's cost is a number of slots")
        if not MIN_WINDOW <= rule.lease <= MAX_SPAN:
            r.problem(found.nodes.get("lease"), f"{key}.lease", "must be from 1ms to 100 years")
    if rule.count_on and rule.cost_header:
        r.problem(found.nodes["count_on"], f"{key}.count_on", "a cost the client declares (header:NAME) is "
                  "charged at admission; count_on charges after the answer (use a number or response_header:NAME)")
    if not rule.refund_on:
        return
    node = found.nodes["refund_on"]
    if after:
        r.problem(node, f"{key}.refund_on", "nothing is charged at admission to give back: the rule is charged "
                  f"after the answer ({after})")
    elif rule.algorithm in (Algorithm.LEAKY_BUCKET, Algorithm.SLIDING_LOG):
        why = ("has already delayed the request" if rule.algorithm == Algorithm.LEAKY_BUCKET
               else "logs each admission at its moment; giving another's back would admit too many")
        r.problem(node, f"{key}.refund_on", f"a {rule.algorithm} cannot give units back: it {why}")


_JSON_PATH = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}$")


def _check_token_budget(rule: Rule, found: Found, key: str, r: _Reader) -> None:
    """A token budget charges at admission and settles the difference, up or down, at the end."""
    allowed = (Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW, Algorithm.QUOTA, Algorithm.TOKEN_BUCKET,
               Algorithm.GCRA)
    if rule.algorithm not in allowed:
        r.problem(found.nodes["cost"], f"{key}.cost", f"a token budget settles up and down after the answer; "
                  f"{rule.algorithm} cannot (use one of {', '.join(allowed)})")
    if rule.count_on:
        r.problem(found.nodes["count_on"], f"{key}.count_on", "a token budget is charged at admission; count_on "
                  "charges after the answer")


def _cost(node: yaml.Node, key: str, r: _Reader) -> dict[str, Any]:
    """{"cost": N} or {"cost_header": NAME}, or a token budget's fields; nothing when refused (the
    rule's other checks still run)."""
    if isinstance(node, yaml.MappingNode):
        return _token_cost(node, key, r)
    text = r.text(node, key)
    if text is None:
        return {}
    if text.startswith("response_header:"):
        header = text[len("response_header:"):].strip().lower()
        if header in UNREADABLE_HEADERS or not re.match(r"^[a-z0-9-]{1,64}$", header):
            r.problem(node, key, f"{text!r} names no header an upstream's answer may carry")
        return {"cost_response_header": header}
    if text.startswith("header:"):
        header = text[len("header:"):].strip().lower()
        if header in UNREADABLE_HEADERS:
            r.problem(node, key, UNREADABLE_HEADERS[header])
        if not re.match(r"^[a-z0-9-]{1,64}$", header):
            r.problem(node, key, f"{text!r} names no valid header")
        return {"cost_header": header}
    try:
        cost = int(text)
        if not 1 <= cost <= MAX_COST:
            raise ValueError
    except ValueError:
        r.problem(node, key, f"{text!r} must be a whole number >= 1, header:NAME or response_header:NAME")
        return {}
    return {"cost": cost}


def _token_cost(node: yaml.Node, key: str, r: _Reader) -> dict[str, Any]:
    """`cost: {reserve: request_json:FIELD | N, default: N, max: N, settle: response_json:PATH}`."""
    nodes = r.mapping(node, key, ("reserve", "default", "max", "settle"))
    if nodes is None:
        return {}
    out: dict[str, Any] = {}
    if "settle" not in nodes:
        r.problem(node, f"{key}.settle", "is required: response_json:PATH, where the answer says what was used")
    else:
        text = r.text(nodes["settle"], f"{key}.settle") or ""
        path = text.removeprefix("response_json:").strip()
        if not text.startswith("response_json:") or not _JSON_PATH.match(path):
            r.problem(nodes["settle"], f"{key}.settle", f"{text!r} must be response_json:PATH (a dotted path of "
                                                        "names: usage.total_tokens)")
        else:
            out["settle_field"] = tuple(path.split("."))
    fallback = 1
    if "default" in nodes:
        text = r.text(nodes["default"], f"{key}.default") or ""
        if not (text.isascii() and text.isdigit()) or not 0 <= int(text) <= MAX_COST:
            r.problem(nodes["default"], f"{key}.default", f"{text!r} must be a whole number from 0 to {MAX_COST}")
        else:
            fallback = int(text)
    out["cost"] = fallback
    if "reserve" in nodes:
        text = r.text(nodes["reserve"], f"{key}.reserve") or ""
        if text.isascii() and text.isdigit():
            out["cost"] = int(text)
            if "default" in nodes:
                r.problem(nodes["default"], f"{key}.default", "a fixed reserve needs no default")
        else:
            path = text.removeprefix("request_json:").strip()
            if not text.startswith("request_json:") or not _JSON_PATH.match(path):
                r.problem(nodes["reserve"], f"{key}.reserve", f"{text!r} must be request_json:FIELD or a number")
            else:
                out["reserve_field"] = tuple(path.split("."))
    if "max" in nodes:
        text = r.text(nodes["max"], f"{key}.max") or ""
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_COST:
            r.problem(nodes["max"], f"{key}.max", f"{text!r} must be a whole number from 1 to {MAX_COST}")
        elif "reserve_field" not in out:
            r.problem(nodes["max"], f"{key}.max", "bounds a reserve read from the request (request_json:FIELD)")
        elif int(text) < fallback:
            r.problem(nodes["max"], f"{key}.max", f"{text} is less than the default reserve {fallback}")
        else:
            out["reserve_max"] = int(text)
    return out


def _warn_untyped_numbers(rule: Rule, found: Found, key: str, r: _Reader, params: Params) -> None:
    """A stock or a duplicate check counted by an untyped path parameter: `/items/042` and `/items/42`
    are one item to an upstream that reads it as a number, and two keys to the rule."""
    if rule.algorithm != Algorithm.QUOTA and not (rule.capacity == 1 and rule.status == 409):
        return
    for j, source in enumerate(rule.by):
        if source.kind == "path" and source.type is None and params.get(source.name) not in TYPES:
            r.warn(found.nodes.get("by"), f"{key}.by[{j}]",
                   f"path parameter {source.name!r} is counted as sent: if the upstream reads it as a number, "
                   f"write {{{source.name}:int}} in the path (or path:{source.name}:int), or 042 and 42 are "
                   "two keys for one item")


CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie")
CREDENTIAL_WORDS = ("key", "token", "auth", "secret", "session", "password", "signature", "credential")


def _says_credential(kind: str, name: str) -> bool:
    """A header, query parameter or cookie whose name says it holds a credential (X-Api-Key,
    ?access_token=, a session cookie)."""
    if kind not in ("header", "query", "cookie"):
        return False
    lowered = name.lower()
    return (kind == "header" and lowered in CREDENTIAL_HEADERS) or any(word in lowered for word in CREDENTIAL_WORDS)


def _source_text(node: yaml.Node, key: str, r: _Reader) -> tuple[str | None, bool | None]:
    """`KIND:NAME`, or `{KIND: NAME, secret: BOOL}`: the source's text and its `secret:`, if given."""
    if not isinstance(node, yaml.MappingNode):
        return r.text(node, key), None
    pairs = {str(k.value): v for k, v in node.value if isinstance(k, yaml.ScalarNode)}
    flag = pairs.pop("secret", None)
    if len(pairs) != 1 or flag is None or len(node.value) != 2:
        r.problem(node, key, "a source with options is {KIND: NAME, secret: true|false}, as {header: X-Tenant, "
                             "secret: true}")
        return None, None
    said = (r.text(flag, f"{key}.secret") or "").strip().lower()
    if said not in ("true", "false"):
        r.problem(flag, f"{key}.secret", f"{said!r} must be true or false")
        return None, None
    [(kind, name_node)] = pairs.items()
    name = r.text(name_node, f"{key}.{kind}")
    return (None if name is None else f"{kind}:{name}"), said == "true"


def _source(node: yaml.Node, key: str, r: _Reader, params: Params, jwt: JwtSettings) -> Source | None:
    text, explicit = _source_text(node, key, r)
    if text is None:
        return None
    source = _source_of(text, node, key, r, params, jwt)
    if source is None:
        return None
    keys = r.keys_source
    if keys is not None and (source.kind, source.name) == (keys.kind, keys.name):
        secret = True  # the API key: whatever a rule says
    else:
        secret = _says_credential(source.kind, source.name) if explicit is None else explicit
    return replace(source, secret=secret)


def _source_of(text: str, node: yaml.Node, key: str, r: _Reader, params: Params,
               jwt: JwtSettings) -> Source | None:
    kind, _, name = text.partition(":")
    kind = kind.strip()
    name = name.strip()
    type_: str | None = None
    if kind in NAMELESS_SOURCES and name in (*TYPES, "str"):
        r.problem(node, key, f"{kind} takes no type (int and float are for {', '.join(TYPED_SOURCES)})")
        return None
    head, colon, tail = name.rpartition(":")
    if colon and tail.strip() in (*TYPES, "str"):
        name, type_ = head.strip(), tail.strip()
        if kind not in TYPED_SOURCES:
            r.problem(node, key, f"{kind} takes no type (int and float are for {', '.join(TYPED_SOURCES)})")
            return None
        if type_ == "str":
            type_ = None
        elif kind == "path" and params.get(name) not in (None, type_):
            r.problem(node, key, f"path parameter {name!r} is {{{name}:{params[name]}}} in the route's path: "
                                 f"it cannot be read as {type_}")
            return None
    if kind not in SOURCE_KINDS:
        known = "ip, method, body, consumer, header:NAME, query:NAME, path:PARAM, cookie:NAME, jwt:CLAIM"
        r.problem(node, key, f"{text!r} is not an identity source (one of: {known})")
        return None
    if kind in NAMELESS_SOURCES:
        if name:
            r.problem(node, key, f"{kind} takes no name")
            return None
        if kind == "consumer" and not _consumer_readable(node, key, r):
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
    if kind == "path" and type_ is None and params.get(name) in TYPES:
        type_ = params[name]  # {item:int}: the router already keeps one spelling; said so in the source
    return Source(kind, name, type_)


def _consumer_readable(node: yaml.Node, key: str, r: _Reader) -> bool:
    """`consumer` (the consumer of the request's API key) needs the keys: section, and is not where
    the key itself is read."""
    if key == "keys.source":
        r.problem(node, key, "consumer is what a key is registered with; keys.source is where a request "
                             "carries the key (header:X-Api-Key, query:api_key, ...)")
        return False
    if r.keys_source is None:
        r.problem(node, key, "consumer identities need a top-level keys: section (a key's consumer is "
                             "registered with it on the admin port, /keys)")
        return False
    return True


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
