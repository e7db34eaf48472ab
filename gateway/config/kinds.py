"""The kinds of value routes.yaml holds: how each is read from text, described by the JSON schema,
and named in the docs.

A scalar kind's `parse` takes the text of one YAML scalar (after `${NAME}` substitution) and returns
the typed value or raises ValueError; the loader reports `must be <noun>: <reason>`. Structural kinds
(a section, a list of sections, a map of named sections) are walked by the loader itself.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from gateway.calendars import NOMINAL, ZONE_SHAPE, Period, zone_problem
from gateway.units import parse_duration, parse_rate
from gateway.urls import reachable

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(path|str|int|float))?\}")

Schema = dict[str, Any]
ENV: Schema = {"$ref": "#/$defs/envRef"}


def or_env(schema: Schema) -> Schema:
    """`schema`, or a `${NAME}` reference the loader replaces before typing the value."""
    return {"anyOf": [schema, ENV]}


class Kind:
    """What a key holds."""

    def describe(self) -> str:
        """Its column in the docs' reference table."""
        raise NotImplementedError

    def schema(self) -> Schema:
        raise NotImplementedError

    def show(self, value: Any) -> str:
        """A default value as an operator would write it."""
        return str(value)


_WHOLE = re.compile(r"-?[0-9]+")


def whole_number(text: str) -> int:
    """A whole number written in ASCII digits: Python's int() also reads "5_0", "+5" and other
    scripts' digits (Arabic-Indic 5 and 0), which no operator means as 50. Raises ValueError."""
    stripped = text.strip()
    if not _WHOLE.fullmatch(stripped):
        raise ValueError(f"{text!r} is not written in digits 0-9")
    return int(stripped)


class Scalar(Kind):
    noun = ""  # "must be <noun>: <reason>"; empty: the reason alone

    def parse(self, text: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Integer(Scalar):
    low: int
    high: int
    noun = "a whole number"

    def describe(self) -> str:
        return f"integer {self.low}..{self.high}" if self.low != self.high else f"{self.low}"

    def parse(self, text: str) -> int:
        value = whole_number(text)
        if not self.low <= value <= self.high:
            raise ValueError(f"{value} is outside {self.low}..{self.high}")
        return value

    def schema(self) -> Schema:
        if self.low == self.high:
            return or_env({"const": self.low})
        return or_env({"type": "integer", "minimum": self.low, "maximum": self.high})


TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")


@dataclass(frozen=True)
class Boolean(Scalar):
    noun = "true or false"

    def describe(self) -> str:
        return "boolean"

    def parse(self, text: str) -> bool:
        lowered = text.strip().lower()
        if lowered in TRUE:
            return True
        if lowered in FALSE:
            return False
        raise ValueError(f"{text!r} is not true or false")

    def schema(self) -> Schema:
        return {"$ref": "#/$defs/boolean"}

    def show(self, value: Any) -> str:
        return "true" if value else "false"


@dataclass(frozen=True)
class Choice(Scalar):
    options: tuple[str, ...]
    noun = "one of the known values"

    def describe(self) -> str:
        return " | ".join(f"`{option}`" for option in self.options)

    def parse(self, text: str) -> str:
        if text not in self.options:
            raise ValueError(f"{text!r} is not one of {', '.join(self.options)}")
        return text

    def schema(self) -> Schema:
        return or_env({"enum": list(self.options)})


@dataclass(frozen=True)
class Duration(Scalar):
    window: bool = False  # at least a millisecond (Redis keeps expiry in milliseconds)
    noun = "a duration"

    def describe(self) -> str:
        return "duration"

    def parse(self, text: str) -> float:
        return parse_duration(text)

    def schema(self) -> Schema:
        return {"$ref": "#/$defs/window" if self.window else "#/$defs/duration"}

    def show(self, value: Any) -> str:
        seconds = float(value)
        for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
            if seconds >= size and seconds % size == 0:
                return f"{seconds / size:g}{unit}"
        return f"{seconds * 1000:g}ms" if seconds else "0s"


@dataclass(frozen=True)
class Window(Duration):
    """A duration, or a calendar period (`day`, `week`, `month`: gateway/calendars.py)."""

    def describe(self) -> str:
        return "duration \\| `day` \\| `week` \\| `month`"

    def parse(self, text: str) -> Any:
        word = text.strip()
        if word in NOMINAL:
            return Period(word)
        return parse_duration(text)

    def schema(self) -> Schema:
        return {"anyOf": [super().schema(), {"enum": list(NOMINAL)}]}

    def show(self, value: Any) -> str:
        return str(value) if isinstance(value, Period) else super().show(value)


@dataclass(frozen=True)
class Rate(Scalar):
    noun = "a rate"

    def describe(self) -> str:
        return "rate"

    def parse(self, text: str) -> float:
        return parse_rate(text)

    def schema(self) -> Schema:
        return {"$ref": "#/$defs/rate"}


@dataclass(frozen=True)
class Name(Scalar):
    noun = "a name"

    def describe(self) -> str:
        return "name"

    def parse(self, text: str) -> str:
        if not NAME.match(text):
            raise ValueError(f"{text!r} must be 1-64 of A-Z a-z 0-9 _ . - (starting alnum)")
        return text

    def schema(self) -> Schema:
        return {"$ref": "#/$defs/name"}


@dataclass(frozen=True)
class Text(Scalar):
    """Free text, or text matching `pattern` (refused with `refusal`, `{value!r}` filled in)."""

    pattern: str | None = None
    refusal: str = ""
    nullable: bool = False  # an empty YAML value (null) means "not set"
    what: str = "text"      # for the docs

    def describe(self) -> str:
        return self.what

    def show(self, value: Any) -> str:
        return str(value) or '""'

    def parse(self, text: str) -> str:
        if self.pattern is not None and not re.match(self.pattern, text):
            raise ValueError(self.refusal.format(value=text))
        return text

    def schema(self) -> Schema:
        text: Schema = {"type": "string"}
        if self.pattern is None:
            return {"type": ["string", "null"]} if self.nullable else text
        text["pattern"] = self.pattern
        alternatives = [{"type": "null"}] if self.nullable else []
        return {"anyOf": [*alternatives, text, ENV]}


@dataclass(frozen=True)
class HostName(Text):
    """A host a route matches, as requests' hosts are matched: lower case, without a trailing dot,
    an internationalized name in its ASCII form (what clients send); no port, no wildcard."""

    what: str = "host name"

    def parse(self, text: str) -> str:
        host = text.strip().lower()
        if "*" in host:
            raise ValueError(f"{text!r}: wildcards are not supported (a route per host)")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"{text!r}: a host is matched without its port")
        host = host.rstrip(".")
        if not host.isascii():
            try:
                host = host.encode("idna").decode("ascii")
            except UnicodeError as exc:
                raise ValueError(f"{text!r} is no host name ({exc})") from None
        return host


@dataclass(frozen=True)
class Url(Text):
    """A URL matching `pattern` that names a port a client can connect to, if it names one."""

    def parse(self, text: str) -> str:
        return reachable(super().parse(text)) if text else text


@dataclass(frozen=True)
class Zone(Text):
    """A time zone every host reads alike (gateway/calendars.py); the schema gives its shape."""

    pattern: str | None = ZONE_SHAPE
    what: str = "IANA time zone"

    def parse(self, text: str) -> str:
        problem = zone_problem(text)
        if problem is not None:
            raise ValueError(problem)
        return text


def path_params(template: str) -> list[str]:
    return [m.group(1) for m in PARAM.finditer(template)]


@dataclass(frozen=True)
class Template(Scalar):
    """A path template in Starlette's syntax: /items/{id}, /{rest:path}."""

    def describe(self) -> str:
        return "path template"

    def parse(self, text: str) -> str:
        if not text.startswith("/"):
            raise ValueError(f"{text!r} must start with /")
        if "{" in PARAM.sub("", text) or "}" in PARAM.sub("", text):
            raise ValueError(f"{text!r} has a malformed {{parameter}} (use {{name}} or {{name:path}})")
        names = path_params(text)
        if len(set(names)) != len(names):
            raise ValueError(f"{text!r} names a parameter twice")
        if any(m.group(2) == "path" and m.end() != len(text) for m in PARAM.finditer(text)):
            raise ValueError(f"{text!r}: a {{name:path}} parameter must come last")
        # requests are matched on their path alone, after dot segments and repeated slashes are
        # resolved: a template holding either would never match (its requests went to a later route)
        if "?" in text or "#" in text:
            raise ValueError(f"{text!r}: a request is matched on its path, without a query or fragment")
        segments = text.split("/")[1:]
        if "//" in text or any(segment in (".", "..") for segment in segments):
            raise ValueError(f"{text!r}: requests are matched with dot segments and repeated slashes "
                             "resolved, so no request could match it")
        return text

    def schema(self) -> Schema:
        last = {"description": "a {name:path} parameter must come last",
                "pattern": r"\{[A-Za-z_][A-Za-z0-9_]*:path\}."}
        return or_env({"type": "string", "pattern": "^/", "not": last})


@dataclass(frozen=True)
class Network(Scalar):
    noun = "an address or CIDR"

    def describe(self) -> str:
        return "address or CIDR"

    def parse(self, text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(text.strip())

    def schema(self) -> Schema:
        v4 = r"^\s*[0-9]{1,3}(\.[0-9]{1,3}){3}(/([0-9]|[12][0-9]|3[0-2]))?\s*$"
        v6 = r"^\s*[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(/([0-9]|[1-9][0-9]|1[01][0-9]|12[0-8]))?\s*$"
        return {"anyOf": [{"type": "string", "pattern": v4}, {"type": "string", "pattern": v6}, ENV]}


def is_typed(kind: Kind) -> bool:
    """Whether the table alone types a key of this kind (a scalar, or a list of scalars); the loader
    walks the others (sections, identity sources, costs) itself."""
    return isinstance(kind, Scalar) or (isinstance(kind, ListOf) and isinstance(kind.item, Scalar))


@dataclass(frozen=True)
class ListOf(Kind):
    item: Kind
    max_items: int | None = None
    single: bool = False  # one item may be given alone, without the list around it

    def describe(self) -> str:
        return f"{self.item.describe()} or list of them" if self.single else f"list of {self.item.describe()}"

    def schema(self) -> Schema:
        out: Schema = {"type": "array", "items": self.item.schema()}
        if self.max_items is not None:
            out["maxItems"] = self.max_items
        return {"anyOf": [self.item.schema(), out]} if self.single else out

    def show(self, value: Any) -> str:
        return "[" + ", ".join(self.item.show(v) for v in value) + "]"


@dataclass(frozen=True)
class Section(Kind):
    """A mapping whose keys are the fields of `place` (see fields.py)."""

    place: str

    def describe(self) -> str:
        return "mapping"

    def schema(self) -> Schema:
        return {"$ref": f"#/$defs/{self.place}"}


@dataclass(frozen=True)
class Named(Kind):
    """A mapping of names to sections of `place`."""

    place: str

    def describe(self) -> str:
        return "mapping of name to mapping"

    def schema(self) -> Schema:
        return {"type": "object", "propertyNames": {"type": "string", "pattern": NAME.pattern},
                "additionalProperties": {"$ref": f"#/$defs/{self.place}"}}


@dataclass(frozen=True)
class Conditions(Kind):
    """A mapping of names (of headers or JWT claims) to a value, a list of values, or (where
    `presence`) true: the name is present with any value. Read by the loader."""

    presence: bool = False

    def describe(self) -> str:
        return "mapping of name to value, [values]" + (" or true" if self.presence else "")

    def schema(self) -> Schema:
        value: Schema = {"anyOf": [{"type": ["string", "number"]}, ENV]}
        choices: list[Schema] = [value, {"type": "array", "items": value, "minItems": 1}]
        if self.presence:
            choices.append({"const": True})
        return {"type": "object", "minProperties": 1,
                "propertyNames": {"type": "string", "pattern": r"^[A-Za-z0-9_.:-]{1,128}$"},
                "additionalProperties": {"anyOf": choices}}


SOURCE_KINDS = ("ip", "method", "body", "consumer", "header", "query", "path", "cookie", "jwt")
NAMELESS_SOURCES = ("ip", "method", "body", "consumer")  # consumer: the API key's (`keys:`)
TYPED_SOURCES = ("path", "query", "header", "cookie", "jwt")  # :int and :float read as the upstream reads them


@dataclass(frozen=True)
class Source(Kind):
    """One identity source; read by the loader, which knows the route's path and the jwt section."""


    def describe(self) -> str:
        return "identity source"

    def schema(self) -> Schema:
        names = [k for k in SOURCE_KINDS if k not in NAMELESS_SOURCES]
        named = "|".join(names)
        return {"anyOf": [
            {"type": "string", "pattern": rf"^\s*({'|'.join(NAMELESS_SOURCES)})\s*$"},
            {"type": "string", "pattern": rf"^\s*({named})\s*:\s*\S.{{0,127}}$"},
            {"description": "A source whose values are (secret: true) or are not (false) credentials, "
                            "shown only as their fingerprint kf_...; by default a name that says "
                            "credential (key, token, auth, ...) is one.",
             "type": "object", "additionalProperties": False, "minProperties": 2, "maxProperties": 2,
             "required": ["secret"],
             "properties": {"secret": {"type": "boolean"},
                            **{kind: {"type": "string", "minLength": 1, "maxLength": 128} for kind in names}}},
            ENV,
        ]}


@dataclass(frozen=True)
class Cost(Kind):
    """A number of units, header:NAME (the client declares it) or response_header:NAME (the
    upstream declares it in its answer)."""

    high: int

    def describe(self) -> str:
        return "integer, header:NAME, response_header:NAME or {reserve, default, max, settle}"

    def schema(self) -> Schema:
        json_path = r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}$"
        return {"anyOf": [
            {"type": "integer", "minimum": 1, "maximum": self.high},
            {"type": "string", "pattern": r"^(response_)?header:\s*[A-Za-z0-9-]{1,64}\s*$"},
            {"type": "object", "additionalProperties": False, "required": ["settle"], "properties": {
                "reserve": {"anyOf": [{"type": "string", "pattern": "^request_json:" + json_path[1:]},
                                      {"type": "integer", "minimum": 0, "maximum": self.high}]},
                "default": {"type": "integer", "minimum": 0, "maximum": self.high},
                "max": {"type": "integer", "minimum": 1, "maximum": self.high},
                "settle": {"type": "string", "pattern": "^response_json:" + json_path[1:]},
            }},
            ENV,
        ]}


@dataclass(frozen=True)
class Status(Scalar):
    """An HTTP status (401) or a class of them (5xx): the statuses it covers."""

    noun = "a status (401) or a class (4xx)"

    def describe(self) -> str:
        return "status or class (4xx)"

    def parse(self, text: str) -> tuple[int, ...]:
        text = text.strip().lower()
        if re.fullmatch(r"[1-5]xx", text):
            first = int(text[0]) * 100
            return tuple(range(first, first + 100))
        if re.fullmatch(r"[1-5][0-9][0-9]", text):
            return (int(text),)
        raise ValueError(f"{text!r} is neither a status from 100 to 599 nor a class such as 5xx")

    def schema(self) -> Schema:
        return or_env({"anyOf": [{"type": "integer", "minimum": 100, "maximum": 599},
                                 {"type": "string", "pattern": r"^\s*([1-5][0-9][0-9]|[1-5][xX][xX])\s*$"}]})


def definitions() -> Schema:
    """The shared `$defs` the kinds refer to."""
    zero = r"^\s*0+(\.0+)?\s*"
    units = "(ms|s|m|min|h|d)"
    return {
        "envRef": {
            "description": "A value read from the environment: ${NAME} or ${NAME:-default}.",
            "type": "string",
            "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?\}",
        },
        "name": or_env({"type": "string", "pattern": NAME.pattern}),
        "duration": {
            "description": "A duration: 50ms, 1s, 5m (or 5min), 1h, 1d.",
            "anyOf": [
                {"type": "string", "pattern": rf"^\s*[0-9]+(\.[0-9]+)?\s*{units}\s*$",
                 "not": {"description": "zero is no duration", "pattern": rf"{zero}{units}\s*$"}},
                ENV,
            ],
        },
        "window": {
            "description": "A duration of at least a millisecond (Redis keeps expiry in milliseconds).",
            "allOf": [{"$ref": "#/$defs/duration"},
                      {"not": {"type": "string", "pattern": r"^\s*0+\.[0-9]+\s*ms\s*$"}}],
        },
        "rate": {
            "description": "A rate: 5/s, 100/min, 1000/h, 10000/d.",
            "anyOf": [
                {"type": "string",
                 "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*/\s*(s|sec|second|min|minute|m|h|hour|d|day)\s*$",
                 "not": {"description": "zero is no rate", "pattern": rf"{zero}/"}},
                ENV,
            ],
        },
        "boolean": {"anyOf": [{"type": "boolean"}, {"enum": [*TRUE, *FALSE, 1, 0]}, ENV]},
    }

