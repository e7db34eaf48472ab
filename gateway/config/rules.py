"""A rule of routes.yaml (under a route's `limits:` or `shared:`): its algorithm's numbers, its
`by:` sources (which fields hold a secret, which no identity can read), its cost, how it settles.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from typing import Any

import yaml

from gateway.calendars import NOMINAL, Period
from gateway.config.fields import (
    BUCKET_ALGORITHMS,
    MAX_COST,
    MAX_RULES,
    MAX_SPAN,
    MIN_WINDOW,
    SLIDING_LOG_MAX,
    Algorithm,
    Place,
    fields,
    keys,
    parameters,
)
from gateway.config.kinds import (
    NAMELESS_SOURCES,
    SOURCE_KINDS,
    TYPED_SOURCES,
    whole_number,
)
from gateway.config.model import (
    JwtSettings,
    Rule,
    Source,
    keeps_full_limit,
    shard_share,
)
from gateway.config.reader import Found, Params, Reader, child_node
from gateway.hop_by_hop import HOP_BY_HOP
from gateway.typed_values import TYPES


def _calendar(found: Found, key: str, r: Reader, algorithm: Algorithm, values: dict[str, Any]) -> None:
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


def read_shared(node: yaml.Node, r: Reader, jwt: JwtSettings) -> dict[str, Rule]:
    """`shared:` rules several routes name ({use: NAME}): one counter wherever used."""
    out: dict[str, Rule] = {}
    for i, item in enumerate(r.sequence(node, "shared") or []):
        if i == MAX_RULES:
            r.problem(item, f"shared[{i}]", f"at most {MAX_RULES} shared rules")
        rule = read_rule(item, f"shared[{i}]", r, {}, jwt)
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


def _use(node: yaml.Node, key: str, r: Reader) -> Rule | None:
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


def read_rules(
    route: Found, key: str, r: Reader, params: Params, jwt: JwtSettings
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
        rule = _use(node, f"{key}.limits[{j}]", r) if uses else read_rule(node, f"{key}.limits[{j}]", r, params, jwt)
        if rule is None:
            continue
        if rule.name in names:
            r.problem(node, f"{key}.limits[{j}].name", f"rule '{rule.name}' is defined twice")
        if r.decision_only:
            for unseen in rule.unseen_by_a_check:
                r.problem(child_node(node, unseen) or node, f"{key}.limits[{j}]({rule.name}).{unseen}",
                          "needs the upstream's answer or the request's body, which the check port "
                          "(--check-port) never sees: move the rule to a route the proxy port serves, or "
                          "drop it")
        names.add(rule.name)
        rules.append(rule)
        nodes.append(node)
    return rules, nodes


def check_shards(
    snode: yaml.Node, key: str, r: Reader, rules: list[Rule], nodes: list[yaml.Node], shards: int
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
        node = child_node(rnode, size) or rnode
        total = rule.quota_size
        if total < shards:
            r.problem(node, f"{where}.{size}",
                      f"{size} {total} is split over shards: {shards}; each shard needs at least 1 "
                      f"(use shards <= {total}, or give the rule the first rule's identity)")
            continue
        smallest = shard_share(total, shards, shards - 1) + (1 if rule.algorithm == Algorithm.LEAKY_BUCKET else 0)
        if rule.cost > smallest:
            r.problem(child_node(rnode, "cost") or node, f"{where}.cost",
                      f"cost {rule.cost} can never fit a shard's share ({smallest} of {size} {total} "
                      f"over shards: {shards})")


def read_rule(node: yaml.Node, key: str, r: Reader, params: Params, jwt: JwtSettings,
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
            read_source(snode, f"{key}.by[{j}]", r, params, jwt)
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
            source = read_source(snode, f"{key}.by[{j}]", r, params, jwt)
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


def _check_settling(rule: Rule, found: Found, key: str, r: Reader) -> None:
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


def _check_token_budget(rule: Rule, found: Found, key: str, r: Reader) -> None:
    """A token budget charges at admission and settles the difference, up or down, at the end."""
    allowed = (Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW, Algorithm.QUOTA, Algorithm.TOKEN_BUCKET,
               Algorithm.GCRA)
    if rule.algorithm not in allowed:
        r.problem(found.nodes["cost"], f"{key}.cost", f"a token budget settles up and down after the answer; "
                  f"{rule.algorithm} cannot (use one of {', '.join(allowed)})")
    if rule.count_on:
        r.problem(found.nodes["count_on"], f"{key}.count_on", "a token budget is charged at admission; count_on "
                  "charges after the answer")


def _cost(node: yaml.Node, key: str, r: Reader) -> dict[str, Any]:
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
        cost = whole_number(text)
        if not 1 <= cost <= MAX_COST:
            raise ValueError
    except ValueError:
        r.problem(node, key, f"{text!r} must be a whole number >= 1, header:NAME or response_header:NAME")
        return {}
    return {"cost": cost}


def _token_cost(node: yaml.Node, key: str, r: Reader) -> dict[str, Any]:
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


def _warn_untyped_numbers(rule: Rule, found: Found, key: str, r: Reader, params: Params) -> None:
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


def _source_text(node: yaml.Node, key: str, r: Reader) -> tuple[str | None, bool | None]:
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


def read_source(node: yaml.Node, key: str, r: Reader, params: Params, jwt: JwtSettings) -> Source | None:
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


def _source_of(text: str, node: yaml.Node, key: str, r: Reader, params: Params,
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


def _consumer_readable(node: yaml.Node, key: str, r: Reader) -> bool:
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
