"""gateway/routes.schema.json stays in step with the loader (gateway/config.py).

The loader is the authority; the schema is for editors and CI. Both must know the same keys at every
level and the same choices for every enumerated value, and they must agree on what is valid: the repo's
routes.yaml and the chart's rendered routes pass both, and documents the loader refuses are refused by
the schema too. Allow-lists written inline in config.py (redis, upstream, match, jwt, ...) are read
from the loader's own error messages, so a key added there without the schema fails here.

Known differences, on purpose: the loader reads every scalar as text, so it also takes quoted numbers
(`limit: "5"`), which the schema refuses; JSON Schema counts 5.0 as an integer, which the loader refuses.
Neither is worth a pattern that would make the schema unreadable.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from gateway import config as cfg
from gateway.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "gateway" / "routes.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DEFS = SCHEMA["$defs"]
PARAMS = ("limit", "window", "rate", "burst", "period")

MINIMAL: dict[str, Any] = {
    "version": 1,
    "redis": {"url": "", "mode": "standalone", "timeout": "50ms", "key_prefix": "rlgw"},
    "defaults": {"failure_mode": "open", "headers": "draft"},
    "jwt": {"algorithms": ["HS256"], "secret": "s3cret"},
    "admin": {"token": ""},
    "identity": {"body_max_bytes": 1024, "max_length": 256},
    "local_refusals": {"max_entries": 100_000, "max_hold": "1s"},
    "upstreams": {"up": {"url": "http://127.0.0.1:9000", "timeout": "1s"}},
    "routes": [{
        "name": "r",
        "match": {"path": "/items/{item}", "methods": ["GET"]},
        "upstream": "up",
        "limits": [{"name": "l", "by": ["ip"], "algorithm": "fixed_window", "limit": 5, "window": "1s"}],
    }],
}


def loader_problems(doc: dict[str, Any] | str, env: dict[str, str] | None = None) -> list[str]:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    try:
        cfg.parse_config(text, "routes.yaml", env or {})
    except ConfigError as exc:
        return [f"{p.key}: {p.message}" for p in exc.problems]
    return []


def schema_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


def with_change(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """MINIMAL with the value at `path` replaced (or added)."""
    doc = copy.deepcopy(MINIMAL)
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return doc


def without(path: tuple[str | int, ...]) -> dict[str, Any]:
    """MINIMAL with the key at `path` removed."""
    doc = copy.deepcopy(MINIMAL)
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return doc


def schema_properties(pointer: str) -> set[str]:
    node: Any = SCHEMA
    for part in pointer.strip("/").split("/"):
        if part:
            node = node[part]
    return set(node["properties"])


def schema_enum(node: dict[str, Any]) -> set[str]:
    if "$ref" in node:
        target: Any = SCHEMA
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    enums = [alt["enum"] for alt in node.get("anyOf", [node]) if "enum" in alt]
    assert len(enums) == 1, node
    return set(enums[0])


def test_schema_is_valid_draft_2020_12() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert loader_problems(MINIMAL) == []
    assert schema_errors(MINIMAL) == []


# --- keys --------------------------------------------------------------------------------------

def test_module_allow_lists_match_schema_keys() -> None:
    assert set(SCHEMA["properties"]) == set(cfg.TOP_KEYS)
    assert set(DEFS["route"]["properties"]) == set(cfg.ROUTE_KEYS)
    assert set(DEFS["rule"]["properties"]) == set(cfg.RULE_KEYS)


# Where an unknown key is planted, and where the schema lists that level's keys.
KEY_LEVELS = [
    ((), ""),
    (("redis",), "/properties/redis"),
    (("defaults",), "/$defs/policy"),
    (("jwt",), "/properties/jwt"),
    (("admin",), "/properties/admin"),
    (("identity",), "/properties/identity"),
    (("local_refusals",), "/properties/local_refusals"),
    (("upstreams", "up"), "/$defs/upstream"),
    (("routes", 0), "/$defs/route"),
    (("routes", 0, "match"), "/$defs/route/properties/match"),
    (("routes", 0, "limits", 0), "/$defs/rule"),
]


@pytest.mark.parametrize(("where", "pointer"), KEY_LEVELS, ids=[".".join(map(str, w)) or "top" for w, _ in KEY_LEVELS])
def test_every_level_knows_the_same_keys(where: tuple[str | int, ...], pointer: str) -> None:
    doc = copy.deepcopy(MINIMAL)
    node: Any = doc
    for part in where:
        node = node[part]
    node["zz_unknown"] = 1
    problems = loader_problems(doc)
    hints = [m for p in problems if (m := re.search(r"unknown key \(allowed here: ([^)]*)\)", p))]
    assert hints, problems
    allowed = {k.strip() for k in hints[0].group(1).split(",")}
    assert allowed == schema_properties(pointer)
    assert any("zz_unknown" in e for e in schema_errors(doc))
    # SPEC: any key of defaults may be set on a route too
    assert schema_properties("/$defs/policy") <= set(cfg.ROUTE_KEYS)


# --- enumerations ---------------------------------------------------------------------------------

EXAMPLE_PARAMS: dict[str, dict[str, Any]] = {
    "fixed_window": {"limit": 5, "window": "1s"},
    "sliding_window": {"limit": 5, "window": "1s"},
    "sliding_log": {"limit": 5, "window": "1m"},
    "token_bucket": {"rate": "5/s", "burst": 5},
    "gcra": {"rate": "5/s", "burst": 5},
    "leaky_bucket": {"rate": "5/s", "burst": 5},
    "quota": {"limit": 100, "period": "1d"},
}

ENUMS = [
    (("redis", "mode"), SCHEMA["properties"]["redis"]["properties"]["mode"], cfg.REDIS_MODES),
    (("defaults", "failure_mode"), DEFS["policy"]["properties"]["failure_mode"], cfg.FAILURE_MODES),
    (("defaults", "headers"), DEFS["policy"]["properties"]["headers"], cfg.HEADER_MODES),
    (("routes", 0, "failure_mode"), DEFS["route"]["properties"]["failure_mode"], cfg.FAILURE_MODES),
    (("routes", 0, "headers"), DEFS["route"]["properties"]["headers"], cfg.HEADER_MODES),
    (("routes", 0, "limits", 0, "algorithm"), DEFS["rule"]["properties"]["algorithm"], cfg.ALGORITHMS),
    (("routes", 0, "limits", 0, "on_missing"), DEFS["rule"]["properties"]["on_missing"], cfg.ON_MISSING),
    (("jwt", "algorithms"), SCHEMA["properties"]["jwt"]["properties"]["algorithms"]["items"], None),
]


@pytest.mark.parametrize(("where", "node", "constant"), ENUMS, ids=[".".join(map(str, e[0])) for e in ENUMS])
def test_every_enumeration_matches_the_loader(where: tuple[str | int, ...], node: dict[str, Any],
                                              constant: tuple[str, ...] | None) -> None:
    enum = schema_enum(node)
    if constant is not None:
        assert enum == set(constant)
    bogus = ["not-a-choice"] if where[-1] == "algorithms" else "not-a-choice"
    problems = loader_problems(with_change(where, bogus))
    listed = [m for p in problems if (m := re.search(r"is not one of (.*)$", p))]
    assert listed, problems
    assert {c.strip() for c in listed[0].group(1).split(",")} == enum
    assert schema_errors(with_change(where, bogus))
    for choice in sorted(enum):
        good = with_change(where, [choice] if where[-1] == "algorithms" else choice)
        if where[-1] == "algorithms" and not choice.startswith("HS"):
            good["jwt"]["public_key"] = "-----BEGIN PUBLIC KEY-----"
        if where[-1] == "algorithm":
            good = with_change(where[:-1], {"name": "l", "by": [], "algorithm": choice, **EXAMPLE_PARAMS[choice]})
        assert loader_problems(good) == [], choice
        assert schema_errors(good) == [], choice


def test_identity_source_kinds_match_the_loader() -> None:
    patterns = [alt["pattern"] for alt in DEFS["source"]["anyOf"] if "pattern" in alt]
    kinds = {k for p in patterns for group in re.findall(r"\(([a-z|]+)\)", p) for k in group.split("|")}
    assert kinds == set(cfg.SOURCE_KINDS)
    for kind in cfg.SOURCE_KINDS:
        source = kind if kind in ("ip", "method", "body") else f"{kind}:item"
        doc = with_change(("routes", 0, "limits", 0, "by"), [source])
        if kind == "jwt":
            doc["jwt"] = {"algorithms": ["HS256"], "secret": "s"}
        assert loader_problems(doc) == [], source
        assert schema_errors(doc) == [], source
    for bad in ("user:x", "header", "ip:x", "cookie:"):
        doc = with_change(("routes", 0, "limits", 0, "by"), [bad])
        assert loader_problems(doc), bad
        assert schema_errors(doc), bad


def test_algorithm_parameters_match_params_for() -> None:
    conditions = {c["if"]["properties"]["algorithm"]["const"]: c["then"] for c in DEFS["rule"]["allOf"]}
    assert set(conditions) == set(cfg.ALGORITHMS) == set(cfg.PARAMS_FOR)
    for algorithm, then in conditions.items():
        takes = set(cfg.PARAMS_FOR[algorithm]) | set(cfg.OPTIONAL_FOR.get(algorithm, ()))
        assert set(then["required"]) == set(cfg.PARAMS_FOR[algorithm]), algorithm
        forbidden = {k for k, v in then.get("properties", {}).items() if v is False}
        assert forbidden == set(PARAMS) - takes, algorithm


def test_name_pattern_matches_the_loader() -> None:
    assert SCHEMA["properties"]["upstreams"]["propertyNames"]["pattern"] == cfg.NAME.pattern
    names = [alt for alt in DEFS["rule"]["properties"]["name"]["anyOf"] if "pattern" in alt]
    assert names[0]["pattern"] == cfg.NAME.pattern


# --- documents ------------------------------------------------------------------------------------

def test_repo_routes_yaml_validates() -> None:
    path = ROOT / "routes.yaml"
    assert path.exists(), "the repository's example routes.yaml is referenced by the README and the image"
    doc = yaml.safe_load(path.read_text())
    assert schema_errors(doc) == []
    assert loader_problems(path.read_text()) == []


@pytest.mark.parametrize("values", [
    {},
    {"redis": {"existingSecret": "redis", "mode": "cluster"}, "admin": {"existingSecret": "admin"}},
    {"routes": (ROOT / "routes.yaml").read_text()},
], ids=["defaults", "cluster-admin-secret", "repo-routes"])
def test_chart_rendered_routes_validate(values: dict[str, Any]) -> None:
    with helm.Chart.load(ROOT / "helm" / "gateway") as chart:
        rendered = chart.render(values, name="gw", namespace="edge")
    configmap = yaml.safe_load(rendered["gateway/templates/configmap.yaml"])
    text = configmap["data"]["routes.yaml"]
    assert schema_errors(yaml.safe_load(text)) == []
    assert loader_problems(text, {"REDIS_MODE": values.get("redis", {}).get("mode", "standalone")}) == []


RULE = ("routes", 0, "limits", 0)
INVALID = [
    ("unknown top key", with_change(("ratelimits",), {})),
    ("version 2", with_change(("version",), 2)),
    ("no routes key", without(("routes",))),
    ("redis url scheme", with_change(("redis", "url"), "http://redis:6379")),
    ("redis timeout unit", with_change(("redis", "timeout"), "50")),
    ("key prefix with a space", with_change(("redis", "key_prefix"), "my prefix")),
    ("upstream url scheme", with_change(("upstreams", "up", "url"), "ftp://files")),
    ("upstream without url", with_change(("upstreams", "up"), {"timeout": "1s"})),
    ("max_connections 0", with_change(("upstreams", "up", "max_connections"), 0)),
    ("upstream name", with_change(("upstreams",), {"bad name": {"url": "http://x"}})),
    ("route without match", without(("routes", 0, "match"))),
    ("path without slash", with_change(("routes", 0, "match", "path"), "items")),
    ("method with a digit", with_change(("routes", 0, "match", "methods"), ["G3T"])),
    ("rule without by", without((*RULE, "by"))),
    ("rule without algorithm", without((*RULE, "algorithm"))),
    ("algorithm misspelt", with_change((*RULE, "algorithm"), "token-bucket")),
    ("window of a bucket", with_change(RULE, {"name": "b", "by": [], "algorithm": "gcra", "rate": "5/s",
                                              "burst": 5, "window": "1s"})),
    ("bucket without burst", with_change(RULE, {"name": "b", "by": [], "algorithm": "token_bucket", "rate": "5/s"})),
    ("period on a window", with_change((*RULE, "period"), "1d")),
    ("rate in words", with_change(RULE, {"name": "b", "by": [], "algorithm": "gcra", "rate": "5 per second",
                                         "burst": 5})),
    ("duration in words", with_change((*RULE, "window"), "5 minutes")),
    ("zero window", with_change((*RULE, "window"), "0s")),
    ("limit 0", with_change((*RULE, "limit"), 0)),
    ("sliding_log too long", with_change(RULE, {"name": "s", "by": ["ip"], "algorithm": "sliding_log",
                                                "limit": 200000, "window": "1h"})),
    ("status 200", with_change((*RULE, "status"), 200)),
    ("cost 0", with_change((*RULE, "cost"), 0)),
    ("cost header without name", with_change((*RULE, "cost"), "header:")),
    ("on_missing allow", with_change((*RULE, "on_missing"), "allow")),
    ("shadow maybe", with_change((*RULE, "shadow"), "maybe")),
    ("trusted proxy hostname", with_change(("trusted_proxies",), ["proxy.internal"])),
    ("body bound 0", with_change(("identity", "body_max_bytes"), 0)),
    ("local refusals negative", with_change(("local_refusals", "max_entries"), -1)),
    ("local refusals in words", with_change(("local_refusals", "max_entries"), "many")),
    ("local refusals held for no time", with_change(("local_refusals", "max_hold"), "0s")),
    ("routes not a list", with_change(("routes",), {"name": "r"})),
]


@pytest.mark.parametrize(("label", "doc"), INVALID, ids=[i[0] for i in INVALID])
def test_documents_the_loader_refuses_are_refused_by_the_schema(label: str, doc: dict[str, Any]) -> None:
    assert loader_problems(doc), f"{label}: the loader accepted it"
    assert schema_errors(doc), f"{label}: the schema accepted it"


def test_environment_references_are_accepted_where_the_loader_substitutes() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["redis"].update(url="${REDIS_URL:-}", mode="${REDIS_MODE:-standalone}", timeout="${REDIS_TIMEOUT:-50ms}")
    doc["upstreams"]["up"]["url"] = "${UP:-http://127.0.0.1:9000}"
    doc["routes"][0]["limits"][0]["limit"] = "${LIMIT:-5}"
    doc["admin"]["token"] = "${ADMIN_TOKEN:-}"
    assert loader_problems(doc) == []
    assert schema_errors(doc) == []


# --- agreement on generated rules -------------------------------------------------------------------

GOOD: dict[str, list[Any]] = {
    "limit": [1, 5, 100_000, 100_001, 1_000_000_000],
    "window": ["1s", "50ms", "1.5m", "2h", "1d", " 10 s ", "0.5ms"],
    "period": ["1d", "30m"],
    "rate": ["5/s", "100/min", "1000/h", "10000/d", "2/sec", "1/minute", "0.5/s", "3 / hour"],
    "burst": [1, 10, 1_000_000_000],
    "status": [400, 409, 429, 503, 599],
    "shadow": [True, False, "yes", "off"],
    "on_missing": ["reject", "skip", "ip"],
}
BAD: dict[str, list[Any]] = {
    "limit": [0, -3, 1_000_000_001, "many", True],
    "window": ["0s", "0.0ms", "10", "1w", "-1s", 5, ""],
    "period": ["0s", "forever"],
    "rate": ["0/s", "0.0/min", "5", "5/w", "5/s/s", "-1/s"],
    "burst": [0, -1, 2_000_000_000, "lots"],
    "status": [399, 600, 200],
    "shadow": ["maybe", 2],
    "on_missing": ["drop"],
}


def rule_variants() -> list[dict[str, Any]]:
    """Every algorithm (and a misspelt one) with its parameters, each good value of every key in
    turn, then each single fault: one bad value, one missing parameter, one foreign parameter."""
    out: list[dict[str, Any]] = []
    for algorithm in (*cfg.ALGORITHMS, "leaky"):
        needed = cfg.PARAMS_FOR.get(algorithm, ("limit", "window"))
        takes = set(needed) | set(cfg.OPTIONAL_FOR.get(algorithm, ()))
        base: dict[str, Any] = {"name": "r", "by": ["ip"], "algorithm": algorithm}
        base.update({key: GOOD[key][0] for key in needed})
        keys = [*sorted(takes), "status", "shadow", "on_missing"]
        for key in keys:
            out += [{**base, key: value} for value in GOOD[key] + BAD[key]]
        out += [{k: v for k, v in base.items() if k != key} for key in needed]
        out += [{**base, key: GOOD[key][0]} for key in sorted(set(PARAMS) - takes)]
        out += [{**base, "name": name} for name in ("x.y_z", "-bad", "has space", "a" * 65)]
    return out


def test_loader_and_schema_agree_on_rules() -> None:
    """Any rule (without cost, whose fit the schema cannot judge) is valid for both or for neither."""
    disagreements = []
    variants = rule_variants()
    for rule in variants:
        doc = with_change(("routes", 0, "limits"), [rule])
        loader, schema = loader_problems(doc), schema_errors(doc)
        if bool(loader) != bool(schema):
            disagreements.append(f"{rule}\n    loader: {loader}\n    schema: {schema}")
    assert not disagreements, f"{len(disagreements)} of {len(variants)} rules:\n" + "\n".join(disagreements)
