"""`cost: response_header:NAME`: the cost an upstream declares, read as it meant it, never as nothing.

A decimal number in any spelling an upstream's language writes one is its value: `7`, `+7`, `007`,
digits of any script (`٣`, as Python's int() reads them), a fraction rounded up (`2.5` is 3: never
less than meant), an exponent (`1e3`). Past the rule's capacity (11 digits, `1e9`): the capacity.
Several fields, or one listing several values: the largest. `0`: nothing, as the upstream says.

A field that is no such number (hex, a negative, text, empty), or a success (2xx) without the field
in its head (a cost sent in a trailer, which the gateway never reads, or forgotten): the rule's
capacity, the most one request can be charged, so a broken upstream, or a request that makes it
answer so, cannot walk around the budget. Each one is a warning naming the upstream and the field,
and counts in gateway_upstream_errors_total{kind="cost"}. An answer that is no success and declares
nothing (a framework's own 404 or 500 page) is charged nothing: it did no work the upstream bills,
and charging it the capacity would spend a caller's whole budget on one error page.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Mapping
from decimal import ROUND_CEILING, Decimal

from gateway import metrics
from gateway.config import Route

log = logging.getLogger("gateway.settlement")

_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")


def declared_cost(value: str, capacity: int) -> int | None:
    """The units a field's value declares, at most `capacity`; None when it is no number."""
    costs = []
    for part in _as_sent(value).split(","):
        text = "".join(_ascii_digit(c) for c in part.strip(" \t"))
        if _NUMBER.match(text) is None:
            return None
        number = Decimal(text)
        costs.append(capacity if number >= capacity else int(number.to_integral_value(ROUND_CEILING)))
    return max(costs)


def charge(fields: Mapping[str, str] | None, name: str, capacity: int, route: Route, rule: str,
           status: int = 200) -> int | None:
    """What an answer's fields make the rule owe (None: the gateway answered itself, nothing is owed)."""
    if fields is None:
        return None
    value = fields.get(name)
    if value is None and not 200 <= status < 300:
        return None
    cost = declared_cost(value, capacity) if value is not None else None
    if cost is not None:
        return cost
    upstream = route.upstream.name if route.upstream is not None else "app"
    metrics.upstream_errors(upstream, "cost").inc()
    found = f"{value[:40]!r}" if value is not None else "none in the answer's head (a trailer is not read)"
    log.warning("upstream %s declared no cost in %s that can be read (%s): route %s rule %s is charged its "
                "capacity, %d", upstream, name, found, route.name, rule, capacity)
    return capacity


def _as_sent(value: str) -> str:
    """A field value read as UTF-8 where it was decoded as Latin-1 (the middleware's ASGI fields)."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _ascii_digit(char: str) -> str:
    if char.isascii():
        return char
    digit = unicodedata.decimal(char, None)  # the Nd digits int() reads; not ², ½
    return str(digit) if digit is not None else char
