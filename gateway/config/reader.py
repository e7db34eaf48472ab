"""A YAML file read node by node: every mapping checked against its place's allow-list, every
scalar typed by its field's kind, `${NAME}` and `${NAME:-default}` replaced from the environment
before a value is typed, and every problem kept with its file, line and key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from gateway.config.fields import (
    Place,
    fields,
    keys,
)
from gateway.config.kinds import (
    ENV_REF,
    Kind,
    ListOf,
    Scalar,
    is_typed,
)
from gateway.config.model import (
    Rule,
    Source,
)
from gateway.errors import ConfigProblem

Params = Mapping[str, str | None]  # a route's path parameters and the type its template gives each


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


class YamlReader:
    """A YAML file's problems with their lines, and the shapes every reader of one checks (a mapping
    of allowed keys, each once; a list; a single value). routes.yaml's reader and the reader of
    envoyproxy/ratelimit's files (gateway/config/rls.py) are both one."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[ConfigProblem] = []

    def problem(self, node: yaml.Node | None, key: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.problems.append(ConfigProblem(self.file, line, key, message))

    def unknown_key(self, name: str | None, allowed: tuple[str, ...]) -> str:
        return f"unknown key (allowed here: {', '.join(allowed)})"

    def mapping(self, node: yaml.Node, key: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node] | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, key or "(document)", "must be a mapping")
            return None
        out: dict[str, yaml.Node] = {}
        for knode, vnode in node.value:
            name = knode.value if isinstance(knode, yaml.ScalarNode) else None
            shown = name if name else "(empty key)" if name == "" else "(non-text key)"
            path = join(key, shown)
            if name not in allowed:
                self.problem(knode, path, self.unknown_key(name, allowed))
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

    def scalar(self, node: yaml.Node, key: str) -> str | None:
        if not isinstance(node, yaml.ScalarNode):
            self.problem(node, key, "must be a single value")
            return None
        return str(node.value)


class Reader(YamlReader):
    """routes.yaml's: walks the node tree, typing values by the field table and collecting problems
    (and warnings) with their lines."""

    def __init__(self, file: str, env: Mapping[str, str], proxy: bool = True, decision_only: bool = False) -> None:
        super().__init__(file)
        self.proxy = proxy  # False: rules guarding an app in-process (routes need no upstream)
        self.decision_only = decision_only  # the check port is on: every rule must be decidable there
        self.env = env
        self.warnings: list[ConfigProblem] = []  # what `gateway check` prints and still accepts
        self.shared: dict[str, Rule] = {}  # the file's `shared:` rules, read before its routes
        self.plans: frozenset[str] | None = None  # the plans a `match: {plan: }` may name (None: no keys:)
        self.keys_source: Source | None = None  # `keys.source`, read before every rule: a secret source

    def warn(self, node: yaml.Node | None, key: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.warnings.append(ConfigProblem(self.file, line, key, message))

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
                self.problem(found.node, join(key, f.key), f"is required {f.required}".rstrip())
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
            value = self.value(found.nodes[f.key], join(key, f.key), f.kind)
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

    def text(self, node: yaml.Node, key: str) -> str | None:
        raw = self.scalar(node, key)
        if raw is None:
            return None

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                if "${" in default:  # `${A:-${B}}`: the inner reference would be kept as text
                    self.problem(node, key, f"the default of ${{{name}}} holds a reference; "
                                            "nested references are not supported")
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


def join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def check_shape(node: yaml.Node, reader: Reader) -> bool:
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


def child_node(node: yaml.Node, name: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            if isinstance(knode, yaml.ScalarNode) and knode.value == name:
                assert isinstance(vnode, yaml.Node)
                return vnode
    return None
