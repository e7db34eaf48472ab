"""Compiled routes: match(method, host, path, meets) -> (Route, path params) | None. First match wins.

A route whose `match` also names who is asking (headers, verified JWT claims, client addresses)
takes a request only when `meets(route)` says the request has them; otherwise the next route is
tried. These conditions never own a path: the 405 rule below is about methods alone.

A route that lists `methods` owns its path: a request for that path with another method is not
taken by a later route without `methods` (a catch-all), only by a later route that names the
method. Nothing matching, `allowed_methods` tells a 405 (with Allow) from a 404. So a catch-all
never becomes a way around the limits of `POST /seckill/{item_id}` for `GET /seckill/42`.

A route that lists GET takes HEAD too (the upstream serves it with its GET handler), and a request
carrying a method-override field is matched as the method the field names, unless the route's
upstream honours none (`method_override: ignore`): what the upstream acts on is what is matched.

A template matches its path with or without one trailing slash (`/seckill/{item_id}` takes
`/seckill/42/` too, with the same parameters): most frameworks behind a gateway serve both as one
resource (Starlette redirects, Django appends, Spring matched both until 6.0), so a slash must not
walk around a limit. The upstream still receives the path as sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import PARAM, Route
from gateway.errors import BadRequest
from gateway.typed_values import TYPES, canonical

# `int` and `float` take every segment with a digit in it (any script's: Python's int() reads fullwidth
# digits), so a spelling some upstream reads as a number (042, +42, 42.0, 4_2, ' 42') is this route's,
# never the next one's; Router.match then keeps one spelling of the number (gateway/typed_values.py)
_PATTERNS = {None: "[^/]+", "str": "[^/]+", "int": r"[^/]*\d[^/]*", "float": r"[^/]*\d[^/]*", "path": ".*"}


def compile_template(template: str, case_insensitive: bool = False) -> re.Pattern[str]:
    if len(template) > 1 and template.endswith("/"):
        template = template[:-1]
    out, last = [], 0
    for m in PARAM.finditer(template):
        out.append(re.escape(template[last : m.start()]))
        out.append(f"(?P<{m.group(1)}>{_PATTERNS[m.group(2)]})")
        last = m.end()
    out.append(re.escape(template[last:]))
    slash = "" if template == "/" else "/?"
    # \Z, not $ (which also matches before a final newline), and DOTALL so that `path` takes any
    # character: a template matches the whole path or nothing (read_request refuses encoded
    # control characters anyway; the middleware's app may see what another server decoded)
    return re.compile("^" + "".join(out) + slash + r"\Z", re.DOTALL | (re.IGNORECASE if case_insensitive else 0))


def typed_params(template: str) -> tuple[tuple[str, str], ...]:
    """The template's {name:int} and {name:float} parameters: (name, type)."""
    return tuple((m.group(1), m.group(2)) for m in PARAM.finditer(template) if m.group(2) in TYPES)


@dataclass(frozen=True)
class CompiledRoute:
    route: Route
    pattern: re.Pattern[str]
    methods: frozenset[str] | None  # GET brings HEAD
    host: str | None
    numbers: tuple[tuple[str, str], ...] = ()  # its {name:int} and {name:float} parameters, with their type
    honours_override: bool = True


def _owned(methods: frozenset[str] | None) -> frozenset[str] | None:
    """A route's methods as it serves them: one that lists GET serves HEAD with it (RFC 9110 9.3.2)."""
    return methods | {"HEAD"} if methods is not None and "GET" in methods else methods


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = tuple(
            CompiledRoute(r, compile_template(r.path, r.path_case == "insensitive"), _owned(r.methods), r.host,
                          typed_params(r.path), r.method_override != "ignore") for r in routes
        )
        self.conditional = any(r.when for r in routes)  # some route asks who is asking

    def match(self, method: str, host: str, path: str, meets: Callable[[Route], bool] | None = None,
              override: str | None = None) -> tuple[Route, dict[str, str]] | None:
        """`override`: the method a method-override field names, which routes whose upstream honours
        one match the request as (`Request.counted_method`)."""
        claimed = False  # an earlier route owns this path under other methods
        for compiled in self.routes:
            if compiled.host is not None and compiled.host != host:
                continue
            acted_on = override if override is not None and compiled.honours_override else method
            if compiled.methods is not None and acted_on not in compiled.methods:
                if not claimed and compiled.pattern.match(path) is not None:
                    claimed = True
                continue
            if claimed and compiled.methods is None:
                continue
            found = compiled.pattern.match(path)
            if found is not None:
                if meets is not None and compiled.route.when and not meets(compiled.route):
                    continue
                params = found.groupdict()
                for name, type_ in compiled.numbers:
                    try:
                        params[name] = canonical(type_, params[name])
                    except ValueError as exc:
                        raise BadRequest(f"path parameter {name} {exc}") from None
                return compiled.route, params
        return None

    def may_match(self, path: str) -> bool:
        """Whether any route, under any host or method, matches `path` (for a request whose checked
        view could not be built, so its host and normalized path are unknown)."""
        return any(compiled.pattern.match(path) is not None for compiled in self.routes)

    def allowed_methods(self, host: str, path: str) -> frozenset[str]:
        """The methods routes name for this path (empty: no route knows it, a 404)."""
        allowed: set[str] = set()
        for compiled in self.routes:
            if compiled.methods is None or (compiled.host is not None and compiled.host != host):
                continue
            if compiled.pattern.match(path) is not None:
                allowed |= compiled.methods
        return frozenset(allowed)

