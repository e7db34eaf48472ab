"""The JSON schema of routes.yaml, generated from the field table, for editors and CI.

    python -m gateway.config.schema > gateway/routes.schema.json

tests/test_schema.py fails while the checked-in file differs from what this prints.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.calendars import NOMINAL
from gateway.config.fields import (
    NO_DEFAULT,
    PARAMETERS,
    PLACES,
    SLIDING_LOG_MAX,
    Algorithm,
    Field,
    Place,
    fields,
    parameters,
)
from gateway.config.kinds import ENV, Boolean, Choice, Duration, Integer, ListOf, Schema, definitions

DESCRIPTION = (
    "The routes.yaml of ratelimit-gateway (reference: docs/configuration.md), for editors and CI. "
    "`gateway check` is the authority: it also checks what a schema cannot (an upstream or path parameter "
    "that does not exist, a cost that can never fit, duplicate names). Any scalar may instead hold ${NAME} "
    "or ${NAME:-default}, replaced from the environment before it is typed. Generated from "
    "gateway/config/fields.py by `python -m gateway.config.schema`; do not edit."
)


def routes_schema() -> Schema:
    """The whole schema: the top level's keys, one `$defs` entry per other place."""
    defs = definitions()
    for place in Place:
        if place is not Place.TOP:
            defs[place.value] = _place(place)
    top = _place(Place.TOP)
    del top["description"]
    # a rate limit service alone (rls:) needs no route and no upstream
    top["required"] = [key for key in top["required"] if key not in ("routes", "upstreams")]
    top["if"] = {"not": {"required": ["rls"]}}
    top["then"] = {"required": ["upstreams", "routes"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://ratelimit-gateway.invalid/routes.schema.json",
        "title": "ratelimit-gateway routes.yaml",
        "description": DESCRIPTION,
        **top,
        "$defs": defs,
    }


def _place(place: Place) -> Schema:
    out: Schema = {"description": PLACES[place], "type": "object", "additionalProperties": False}
    # a rule needs `by` in a route, and has none in an RLS descriptor (its values are its identity)
    required = [f.key for f in fields(place) if f.required is not None and (place, f.key) != (Place.RULE, "by")]
    if required:
        out["required"] = required
    out["properties"] = {f.key: _field(f) for f in fields(place)}
    if place is Place.RULE:
        out["allOf"] = [_algorithm(a) for a in Algorithm]
    if place is Place.ROUTE:  # a respond: usage route answers itself, with no upstream
        out["required"] = [key for key in out["required"] if key != "upstream"]
        out["if"] = {"not": {"required": ["respond"]}}
        out["then"] = {"required": ["upstream"]}
    return out


def _field(f: Field) -> Schema:
    out: Schema = {"description": f.doc, **f.kind.schema()}
    if (f.places, f.key) == ((Place.ROUTE,), "limits"):  # a rule of its own, or {use: NAME}
        out["items"] = {"anyOf": [{"allOf": [out["items"], {"required": ["by"]}]}, {"$ref": "#/$defs/use"}]}
    elif (f.places, f.key) == ((Place.TOP,), "shared"):
        out["items"] = {"allOf": [out["items"], {"required": ["by"]}]}
    elif (f.places, f.key) == ((Place.RLS_DESCRIPTOR,), "limit"):
        out = {"description": f.doc, "allOf": [f.kind.schema(), {"not": {"required": ["by"]}}]}
    default = _default(f)
    if default is not None:
        out["default"] = default
    return out


def _default(f: Field) -> Any:
    if f.shown or f.default is NO_DEFAULT or f.default is None or f.is_parameter:
        return None
    if isinstance(f.kind, Duration):
        return f.kind.show(f.default)
    if isinstance(f.kind, ListOf):
        return list(f.default)
    if isinstance(f.kind, Integer | Boolean | Choice) or isinstance(f.default, str):
        return f.default
    return None


def _algorithm(algorithm: Algorithm) -> Schema:
    """The keys `algorithm` needs, and those it does not take."""
    needed, optional = parameters(algorithm)
    then: Schema = {"required": list(needed),
                    "properties": {p: False for p in PARAMETERS if p not in needed + optional}}
    if algorithm in (Algorithm.SLIDING_LOG, Algorithm.CONCURRENCY):
        then["properties"]["limit"] = {
            "description": f"{algorithm.value} keeps one entry per request: at most {SLIDING_LOG_MAX}",
            "anyOf": [{"type": "integer", "maximum": SLIDING_LOG_MAX}, ENV],
        }
    if algorithm is Algorithm.CONCURRENCY:  # slots always come back when a request ends
        then["properties"].update(count_on=False, refund_on=False)
    words = {"enum": list(NOMINAL)}
    if algorithm in (Algorithm.SLIDING_WINDOW, Algorithm.SLIDING_LOG):  # a calendar period: fixed windows only
        then["properties"]["window"] = {"not": words}
    if algorithm in (Algorithm.FIXED_WINDOW, Algorithm.QUOTA):  # `calendar` goes with a calendar period
        span = "period" if algorithm is Algorithm.QUOTA else "window"
        then["if"] = {"required": ["calendar"]}
        then["then"] = {"required": [span], "properties": {span: words}}
    return {"if": {"properties": {"algorithm": {"const": algorithm.value}}, "required": ["algorithm"]},
            "then": then}


def render() -> str:
    return json.dumps(routes_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(render(), end="")
