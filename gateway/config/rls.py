"""The rate limit service's configuration (`rls:` in routes.yaml): envoyproxy/ratelimit's own files,
read as that server reads them, and the assembly of a domain (either form) into an `RlsDomain`.

envoyproxy/ratelimit's format (its README, src/config/config_impl.go):

    domain: mongo_cps
    descriptors:
      - key: database            # required
        value: users             # optional: absent, any value (each its own count); `x*`, a prefix
        rate_limit:              # optional: no rate_limit, no limit where a descriptor ends here
          unit: second           # second, minute, hour, day, week, month (30 days), year (365 days)
          requests_per_unit: 500
          name: users_db         # what `replaces` names
          replaces: [{name: x}]  # limits not applied when a request matches this one too
          unlimited: false       # true: OK, counted by nothing (no unit then)
        shadow_mode: false       # counted, never refused
        detailed_metric: false   # accepted; metrics here are per rule already
        descriptors: [...]

Its checks are kept (unknown key, empty key, duplicate composite key, bad unit, a unit beside
`unlimited`, an empty or self `replaces`, empty or duplicate domain) and each names the file, line
and key, as routes.yaml's problems do.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.config.fields import Algorithm
from gateway.config.model import RlsDescriptor, RlsDomain, Route, Rule, Source
from gateway.config.reader import YamlReader
from gateway.errors import ConfigProblem

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 16
# envoyproxy/ratelimit's unit names and their lengths in seconds (MONTH and YEAR as it counts them)
UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400, "month": 30 * 86400,
         "year": 365 * 86400}
_DESCRIPTOR_KEYS = ("key", "value", "rate_limit", "descriptors", "shadow_mode", "detailed_metric")
_LIMIT_KEYS = ("unit", "requests_per_unit", "unlimited", "name", "replaces")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
DOMAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,55}$")  # in `rls.<domain>`, a route name


@dataclass
class Node:
    """A descriptor entry of either form, before its rule has a place in the domain's route."""

    key: str
    value: str
    line: int
    rule: Rule | None = None
    unlimited: bool = False
    limit_name: str = ""
    replaces: tuple[str, ...] = ()
    children: list[Node] = field(default_factory=list)


@dataclass
class DomainSource:
    name: str
    file: str
    line: int
    nodes: list[Node]
    shards: int = 1


class _FileReader(YamlReader):
    """envoyproxy/ratelimit's file, with its own words for an unknown key."""

    def unknown_key(self, name: str | None, allowed: tuple[str, ...]) -> str:
        return f"config error, unknown key '{name}' (allowed here: {', '.join(allowed)})"

    def boolean(self, nodes: dict[str, yaml.Node], name: str, key: str) -> bool:
        if name not in nodes:
            return False
        text = self.scalar(nodes[name], f"{key}.{name}")
        if text is None:
            return False
        if text.lower() not in ("true", "false"):
            self.problem(nodes[name], f"{key}.{name}", "must be true or false")
            return False
        return text.lower() == "true"

    def listed(self, node: yaml.Node, key: str) -> list[yaml.Node]:
        """A list, where an empty value (`descriptors:` with nothing after it) is an empty one."""
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return []
        return self.sequence(node, key) or []


def read_file(path: Path, shown: str) -> tuple[DomainSource | None, list[ConfigProblem]]:
    """One envoyproxy/ratelimit config file; `shown` is how problems name it."""
    reader = _FileReader(shown)
    try:
        data = path.read_bytes()[:MAX_FILE_BYTES + 1]
    except OSError as exc:
        return None, [ConfigProblem(shown, 0, "(file)", f"cannot read: {exc.strerror}")]
    if len(data) > MAX_FILE_BYTES:
        return None, [ConfigProblem(shown, 0, "(file)", "larger than 4 MiB")]
    try:
        root = yaml.compose(data.decode("utf-8"), Loader=yaml.SafeLoader)
    except UnicodeDecodeError as exc:
        return None, [ConfigProblem(shown, 1, "(document)", f"not UTF-8: {exc}")]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        return None, [ConfigProblem(shown, mark.line + 1 if mark else 1, "(document)",
                                    f"error loading config file: {exc.problem or exc.context}")]
    except (yaml.YAMLError, RecursionError) as exc:
        return None, [ConfigProblem(shown, 1, "(document)", f"error loading config file: {exc}")]
    if root is None:
        return None, [ConfigProblem(shown, 1, "(document)", "the file is empty")]
    top = reader.mapping(root, "", ("domain", "descriptors"))
    if top is None:
        return None, reader.problems
    domain = reader.scalar(top["domain"], "domain") if "domain" in top else ""
    if not domain:
        reader.problem(top.get("domain", root), "domain", "config file cannot have empty domain")
    elif not DOMAIN.match(domain):
        reader.problem(top["domain"], "domain", "must be 1 to 56 of A-Z a-z 0-9 _ . - (it names the domain's "
                                                "keys and metrics)")
    nodes = _file_nodes(reader, top.get("descriptors"), "descriptors", 1)
    if reader.problems or not domain:
        return None, reader.problems
    return DomainSource(domain, shown, root.start_mark.line + 1, nodes), []


def _file_nodes(reader: _FileReader, node: yaml.Node | None, key: str, depth: int) -> list[Node]:
    if node is None:
        return []
    if depth > MAX_DEPTH:
        reader.problem(node, key, f"descriptors nest deeper than {MAX_DEPTH}")
        return []
    out: list[Node] = []
    seen: set[str] = set()
    for i, item in enumerate(reader.listed(node, key)):
        here = f"{key}[{i}]"
        found = reader.mapping(item, here, _DESCRIPTOR_KEYS)
        if found is None:
            continue
        entry_key = reader.scalar(found["key"], f"{here}.key") if "key" in found else ""
        if not entry_key:
            reader.problem(found.get("key", item), f"{here}.key", "descriptor has empty key")
            continue
        value = (reader.scalar(found["value"], f"{here}.value") or "") if "value" in found else ""
        composite = f"{entry_key}_{value}" if value else entry_key
        if composite in seen:
            reader.problem(item, here, f"duplicate descriptor composite key '{composite}'")
        seen.add(composite)
        line = item.start_mark.line + 1
        entry = Node(entry_key, value, line)
        shadow = reader.boolean(found, "shadow_mode", here)
        reader.boolean(found, "detailed_metric", here)
        if "rate_limit" in found:
            _file_limit(reader, found["rate_limit"], f"{here}.rate_limit", entry, shadow)
        entry.children = _file_nodes(reader, found.get("descriptors"), f"{here}.descriptors", depth + 1)
        out.append(entry)
    return out


def _file_limit(reader: _FileReader, node: yaml.Node, key: str, entry: Node, shadow: bool) -> None:
    found = reader.mapping(node, key, _LIMIT_KEYS)
    if found is None:
        return
    unlimited = reader.boolean(found, "unlimited", key)
    unit = (reader.scalar(found["unit"], f"{key}.unit") or "").lower() if "unit" in found else ""
    name = (reader.scalar(found["name"], f"{key}.name") or "") if "name" in found else ""
    replaces: list[str] = []
    for j, item in enumerate(reader.listed(found["replaces"], f"{key}.replaces") if "replaces" in found else []):
        named = reader.mapping(item, f"{key}.replaces[{j}]", ("name",))
        target = reader.scalar(named["name"], f"{key}.replaces[{j}].name") if named and "name" in named else ""
        if not target:
            reader.problem(item, f"{key}.replaces[{j}]", "should not have an empty replaces entry")
        elif target == name:
            reader.problem(item, f"{key}.replaces[{j}]", "replaces should not contain name of same descriptor")
        else:
            replaces.append(target)
    entry.limit_name, entry.replaces = name, tuple(replaces)
    if unlimited:
        if unit in UNITS:
            reader.problem(found["unit"], f"{key}.unit", "should not specify rate limit unit when unlimited")
        entry.unlimited = True
        return
    if unit not in UNITS:
        reader.problem(found.get("unit", node), f"{key}.unit",
                       f"invalid rate limit unit '{unit}' (one of {', '.join(UNITS)})")
        return
    text = reader.scalar(found["requests_per_unit"], f"{key}.requests_per_unit") if "requests_per_unit" in found \
        else "0"
    given = found.get("requests_per_unit")
    quoted = isinstance(given, yaml.ScalarNode) and given.style in ("'", '"')
    if text is not None and quoted:  # a string: envoyproxy/ratelimit's loader refuses it too
        reader.problem(found["requests_per_unit"], f"{key}.requests_per_unit",
                       f"is the string {text!r}: write the number without quotes")
        return
    if text is None or not text.isascii() or not text.isdigit() or int(text) >= 2**32:
        reader.problem(found.get("requests_per_unit"), f"{key}.requests_per_unit",
                       "must be a whole number from 0 to 4294967295")
        return
    entry.rule = Rule(name="", by=(), algorithm=Algorithm.FIXED_WINDOW, limit=int(text), window=float(UNITS[unit]),
                      shadow=shadow)  # requests_per_unit 0 refuses every request, as envoyproxy/ratelimit does


def rule_name(path: list[str]) -> str:
    """A rule name from the composite keys on the way to it (`key` or `key_value`, as
    envoyproxy/ratelimit's stats name it), made a valid name."""
    name = _UNSAFE.sub("_", ".".join(path)).strip("_.-") or "descriptor"
    return name[:64] if name[0].isalnum() else ("d" + name)[:64]


def assemble(source: DomainSource, route_fields: dict[str, object]) -> tuple[RlsDomain | None, list[ConfigProblem]]:
    """The domain of `source`: every rule of its tree named and placed in a route `rls.<domain>`."""
    rules: list[Rule] = []
    names: list[str] = []
    problems: list[ConfigProblem] = []
    taken: set[str] = set()

    def place(nodes: list[Node], path: list[str], keys: tuple[str, ...]) -> tuple[RlsDescriptor, ...]:
        out = []
        for node in nodes:
            here = [*path, f"{node.key}_{node.value}" if node.value else node.key]
            entries = (*keys, node.key)
            index = None
            if node.rule is not None:
                if node.rule.name in taken:  # named in the native form: names are the user's
                    problems.append(ConfigProblem(source.file, node.line, f"rls.domains.{source.name}",
                                                  f"rule '{node.rule.name}' is defined twice in the domain"))
                name = node.rule.name or rule_name(here)
                base, n = name, 2
                while name in taken:
                    name = f"{base[:60]}-{n}"
                    n += 1
                taken.add(name)
                index = len(rules)
                # its identity: the values of the descriptor's entries, one source each (the admin
                # port's ?key= takes one value per entry, as it takes one per source of a route's rule)
                rules.append(dataclasses.replace(node.rule, name=name,
                                                 by=tuple(Source("descriptor", key) for key in entries)))
                names.append(node.limit_name or name)
            out.append(RlsDescriptor(node.key, node.value, index, node.unlimited, node.replaces,
                                     place(node.children, here, entries)))
        return tuple(out)

    descriptors = place(source.nodes, [], ())
    if problems:
        return None, problems
    route = Route(name=f"rls.{source.name}", path="/", methods=None, host=None, upstream=None, limits=tuple(rules),
                  **route_fields)  # type: ignore[arg-type]
    return RlsDomain(source.name, route, descriptors, tuple(names)), []
