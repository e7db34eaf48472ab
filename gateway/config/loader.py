"""routes.yaml -> validated, frozen objects (model.py), driven by the field table (fields.py).

The file is read by `reader.Reader` (each mapping against its place's allow-list, each scalar typed
by its field's kind, `${NAME}` and `${NAME:-default}` replaced from the environment); its rules by
rules.py, its `rls:` section by rls_sections.py; here, the rest: redis, upstreams, keys, routes and
their conditions, protect. What the table cannot say (an upstream or path parameter that does not
exist, a cost that can never fit, a shard's share) is checked where it is read. Every problem names
the file, the line and the key, and all problems are reported together.
"""

from __future__ import annotations

import difflib
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gateway.config.fields import (
    Place,
    default,
    fields,
    keys,
)
from gateway.config.kinds import (
    PARAM,
    TRUE,
    Name,
)
from gateway.config.model import (
    Conditions,
    Config,
    JwtSettings,
    KeysSettings,
    Priority,
    Protect,
    RedisSettings,
    Route,
    Upstream,
    UpstreamTls,
)
from gateway.config.reader import Found, Reader, check_shape, child_node
from gateway.config.rls_sections import rls_section
from gateway.config.rules import UNREADABLE_HEADERS, check_shards, read_rules, read_shared, read_source
from gateway.errors import ConfigError, ConfigProblem

MAX_FILE_BYTES = 4 * 1024 * 1024


# RFC 9110's methods, PATCH (RFC 5789), WebDAV's (RFC 4918, 3253, 5323) and the common cache purge
KNOWN_METHODS = frozenset({
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY",
    "PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "REPORT", "SEARCH", "MKCALENDAR",
    "PURGE",
})


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
    reader = Reader(file, env, proxy, decision_only)
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
    if not check_shape(root, reader):
        raise ConfigError(reader.problems)
    config = _build(root, reader)
    if reader.problems or config is None:
        raise ConfigError(reader.problems)
    return replace(config, warnings=tuple(reader.warnings)) if reader.warnings else config


def _build(root: yaml.Node, r: Reader) -> Config | None:
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
        r.shared = read_shared(top.nodes["shared"], r, jwt)
    routes = _routes(top, r, upstreams, defaults, jwt)
    _check_plans(top, routes, keys_settings, r)
    rls_files: list[str] = []
    rls = () if "rls" not in top else rls_section(top.nodes["rls"], r, defaults, {route.name for route in routes},
                                                  rls_files)
    if r.problems:
        return None
    return Config(source=r.file, redis=redis, upstreams=upstreams, routes=routes, jwt=jwt, rls=rls,
                  rls_files=tuple(rls_files), keys=keys_settings, **settings)


def _redis(top: Found, r: Reader) -> RedisSettings:
    found = r.section(top.nodes["redis"], "redis", Place.REDIS) if "redis" in top else None
    return RedisSettings(**r.read(found, "redis", Place.REDIS)) if found else RedisSettings()


def _jwt(node: yaml.Node, r: Reader) -> JwtSettings:
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


def _upstreams(top: Found, r: Reader, jwt: JwtSettings) -> dict[str, Upstream]:
    if "upstreams" not in top:
        return {}
    node = top.nodes["upstreams"]
    if not isinstance(node, yaml.MappingNode):
        r.problem(node, "upstreams", "must be a mapping of name -> upstream")
        return {}
    out: dict[str, Upstream] = {}
    named: set[str] = set()
    for knode, vnode in node.value:
        name = r.value(knode, "upstreams", Name())
        if name is None:
            continue
        key = f"upstreams.{name}"
        if name in named:  # (YAML keeps the last: the first would be silently gone)
            r.problem(knode, key, "appears twice")
            continue
        named.add(name)
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


def _tls(node: yaml.Node, key: str, r: Reader) -> UpstreamTls | None:
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
    _tls_readable(found, key, values, r)
    return UpstreamTls(**values)


def _tls_readable(found: Found, key: str, values: dict[str, Any], r: Reader) -> None:
    """The files as OpenSSL will read them at the first connection (a CA that is not PEM was a
    request that never got its answer)."""
    ca, cert, private = values.get("ca"), values.get("cert"), values.get("key")
    context = ssl.create_default_context()
    if ca and os.path.isfile(ca):
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            r.problem(found.nodes["ca"], f"{key}.ca", f"{ca} holds no certificate OpenSSL can read (PEM): {exc}")
    if cert and private and os.path.isfile(cert) and os.path.isfile(private):
        try:
            context.load_cert_chain(cert, private)
        except (ssl.SSLError, OSError) as exc:
            r.problem(found.nodes["cert"], f"{key}.cert",
                      f"{cert} and {private} are no certificate and private key OpenSSL can pair (PEM): {exc}")


def _keys(node: yaml.Node, r: Reader, jwt: JwtSettings) -> KeysSettings | None:
    """`keys:` API keys and plans at runtime (gateway/api_keys.py)."""
    found = r.section(node, "keys", Place.KEYS)
    if found is None or found.missing:
        return None
    values = r.read(found, "keys", Place.KEYS, skip=["source"])
    source = read_source(found.nodes["source"], "keys.source", r, {}, jwt)
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


def _check_plans(top: Found, routes: tuple[Route, ...], keys_settings: KeysSettings | None, r: Reader) -> None:
    """A route's `match.plan` names plans of `keys:` (`none` with unknown: pass)."""
    known = set(keys_settings.plans) if keys_settings else set()
    if keys_settings is not None and keys_settings.unknown == "pass":
        known.add("none")
    items = top.nodes["routes"].value if "routes" in top and isinstance(top.nodes["routes"], yaml.SequenceNode) else []
    for i, item in enumerate(items):
        name = child_node(item, "name")
        route = next((x for x in routes if name is not None and x.name == name.value), None)
        if route is None or not route.when.plans - known:
            continue
        node = child_node(child_node(item, "match") or item, "plan") or item
        where = f"routes[{i}]({route.name}).match.plan"
        if keys_settings is None and "keys" not in top:
            r.problem(node, where, "matching on a plan needs a top-level keys: section")
            continue
        for plan in sorted(route.when.plans - known):
            near = difflib.get_close_matches(plan, sorted(known), n=1)
            r.problem(node, where, f"no plan named {plan!r} in keys.plans" +
                      (f" (did you mean {near[0]}?)" if near else f" (plans: {', '.join(sorted(known))})"))


def _routes(
    top: Found, r: Reader, upstreams: dict[str, Upstream], defaults: dict[str, str], jwt: JwtSettings
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
                r.problem(child_node(item, "usage_of"), f"routes[{i}]({route.name}).usage_of",
                          f"no route named {name!r}" + (f" (did you mean {near[0]}?)" if near else ""))
    return tuple(out)


def _takes_every_request(route: Route) -> bool:
    """A route whose template matches any path, for any method and host, whoever asks."""
    return (re.fullmatch(r"/\{[A-Za-z_][A-Za-z0-9_]*:path\}", route.path) is not None and route.methods is None
            and route.host is None and not route.when)


def _route(
    node: yaml.Node, key: str, r: Reader, upstreams: dict[str, Upstream], defaults: dict[str, str],
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
    rules, rule_nodes = read_rules(found, key, r, {m.group(1): m.group(2) for m in PARAM.finditer(path)}, jwt)
    if values.get("shards", 1) > 1:
        check_shards(found.nodes["shards"], key, r, rules, rule_nodes, values["shards"])
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


def _match(node: yaml.Node, key: str, r: Reader,
           jwt: JwtSettings) -> tuple[str, frozenset[str] | None, str | None, Conditions, str]:
    found = r.section(node, key, Place.MATCH)
    if found is None:
        return "/", None, None, Conditions(), "sensitive"
    values = r.read(found, key, Place.MATCH)
    methods = _methods(found, key, r, values)
    when = _when(found, key, r, jwt, values)
    return values.get("path") or "/", methods, values.get("host", "").lower() or None, when, values.get(
        "path_case", "sensitive")


def _methods(found: Found, key: str, r: Reader, values: dict[str, Any]) -> frozenset[str] | None:
    methods = frozenset(m.upper() for m in values["methods"]) if "methods" in values else None
    for method in sorted(methods or ()):
        if method not in KNOWN_METHODS:
            near = difflib.get_close_matches(method, sorted(KNOWN_METHODS), n=1)
            r.problem(found.nodes["methods"], f"{key}.methods",
                      f"{method} is no HTTP method" + (f" (did you mean {near[0]}?)" if near else ""))
    return methods


def _when(found: Found, key: str, r: Reader, jwt: JwtSettings, values: dict[str, Any]) -> Conditions:
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


def _conditions(found: Found, place: str, key: str, r: Reader,
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


def _protect(node: yaml.Node, key: str, r: Reader, jwt: JwtSettings) -> Protect | None:
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


def _priorities(node: yaml.Node, key: str, r: Reader, jwt: JwtSettings) -> tuple[Priority, ...]:
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


def _queue(priority: Found, key: str, r: Reader) -> tuple[int, float]:
    """A priority's queue: its size and timeout; (0, 0.0): none."""
    if "queue" not in priority:
        return 0, 0.0
    found = r.section(priority.nodes["queue"], f"{key}.queue", Place.QUEUE)
    if found is None:
        return 0, 0.0
    values = r.read(found, f"{key}.queue", Place.QUEUE)
    return values.get("size", 0), values.get("timeout", 1.0)


def _check_priority_plans(found: Found, key: str, r: Reader, plans: frozenset[str]) -> None:
    if not plans:
        return
    if r.plans is None:
        r.problem(found.nodes["plan"], key, "matching on a plan needs a top-level keys: section")
        return
    for plan in sorted(plans - r.plans):
        near = difflib.get_close_matches(plan, sorted(r.plans), n=1)
        r.problem(found.nodes["plan"], key, f"no plan named {plan!r} in keys.plans" +
                  (f" (did you mean {near[0]}?)" if near else f" (plans: {', '.join(sorted(r.plans))})"))
