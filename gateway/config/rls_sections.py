"""routes.yaml's `rls:` section: the rate limit service's domains, written natively (a descriptor
tree whose leaves are rules) or as envoyproxy/ratelimit's own files (gateway/config/rls.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.config import rls
from gateway.config.fields import (
    BUCKET_ALGORITHMS,
    Algorithm,
    Place,
)
from gateway.config.model import (
    JwtSettings,
    RlsDomain,
)
from gateway.config.reader import Reader, child_node
from gateway.config.rules import read_rule


def rls_section(node: yaml.Node, r: Reader, defaults: dict[str, str], route_names: set[str],
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


def _rls_native(node: yaml.Node, r: Reader) -> list[tuple[rls.DomainSource, yaml.Node]]:
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


def _check_rls_shards(nodes: list[rls.Node], snode: yaml.Node, key: str, r: Reader, shards: int) -> None:
    """Every rule of a sharded domain may hold only its share in a shard: each share at least 1."""
    for node in nodes:
        rule = node.rule
        if rule is not None and rule.quota_size < shards:
            size = "burst" if rule.algorithm in BUCKET_ALGORITHMS else "limit"
            r.problem(snode, f"{key}.shards", f"rule {rule.name!r} ({size} {rule.quota_size}) cannot be split over "
                                              f"{shards} shards: where it is not a call's first descriptor it holds "
                                              "a share in each shard, and each needs at least 1")
        _check_rls_shards(node.children, snode, key, r, shards)


def _rls_descriptors(node: yaml.Node, key: str, r: Reader, depth: int) -> list[rls.Node]:
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
            rule = read_rule(found.nodes["limit"], f"{here}.limit", r, {}, JwtSettings(), keyed=False)
            if rule is not None:
                if rule.by:
                    r.problem(child_node(found.nodes["limit"], "by"), f"{here}.limit.by",
                              "a descriptor's rule counts by the descriptor's values: leave out `by`")
                for unseen in (k for k in rule.unseen_by_a_check if k != "by"):
                    r.problem(child_node(found.nodes["limit"], unseen) or item, f"{here}.limit.{unseen}",
                              "needs the upstream's answer, which the rate limit service never sees")
                if rule.algorithm == Algorithm.LEAKY_BUCKET:
                    r.problem(child_node(found.nodes["limit"], "algorithm") or item, f"{here}.limit.algorithm",
                              "leaky_bucket admits a request after a delay, and Envoy cannot be told to wait "
                              "(its rate limit call times out, 20ms by default): use gcra or token_bucket, "
                              "which refuse at once")
                entry.rule, entry.limit_name = rule, rule.name
        if "descriptors" in found:
            entry.children = _rls_descriptors(found.nodes["descriptors"], f"{here}.descriptors", r, depth + 1)
        out.append(entry)
    return out
