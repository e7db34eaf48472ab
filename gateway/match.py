"""Compiled routes: match(method, host, path) -> (Route, path params) | None. First match wins."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import PARAM, Route

_PATTERNS = {None: "[^/]+", "str": "[^/]+", "int": "[0-9]+", "path": ".*"}


def compile_template(template: str) -> re.Pattern[str]:
    out, last = [], 0
    for m in PARAM.finditer(template):
        out.append(re.escape(template[last : m.start()]))
        out.append(f"(?P<{m.group(1)}>{_PATTERNS[m.group(2)]})")
        last = m.end()
    out.append(re.escape(template[last:]))
    return re.compile("^" + "".join(out) + "$")


@dataclass(frozen=True)
class CompiledRoute:
    route: Route
    pattern: re.Pattern[str]
    methods: frozenset[str] | None
    host: str | None


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = tuple(
            CompiledRoute(r, compile_template(r.path), r.methods, r.host) for r in routes
        )

    def match(self, method: str, host: str, path: str) -> tuple[Route, dict[str, str]] | None:
        for compiled in self.routes:
            if compiled.methods is not None and method not in compiled.methods:
                continue
            if compiled.host is not None and compiled.host != host:
                continue
            found = compiled.pattern.match(path)
            if found is not None:
                return compiled.route, found.groupdict()
        return None
