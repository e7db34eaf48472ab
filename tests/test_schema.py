"""The JSON schema (gateway/routes.schema.json) and the reference (docs/configuration.md) are generated
from the field table (gateway/config/fields.py), and agree with the loader on what is valid.

The loader is the authority; the schema is for editors and CI. Both are driven by one table, so the
checks here are that the checked-in files are current, and that the loader and the schema accept and
refuse the same documents: the repo's routes.yaml, every example in the docs and the chart's rendered
routes pass both; the documents and the loader_cases files the loader refuses are refused by the schema
too, where a schema can say why.

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

from gateway.config import Algorithm, Place, parse_config
from gateway.config.fields import ALGORITHMS, PARAMETERS, field, keys, parameters
from gateway.config.kinds import NAMELESS_SOURCES, SOURCE_KINDS, Choice, ListOf
from gateway.config.reference import render as render_reference
from gateway.config.schema import render as render_schema
from gateway.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "gateway" / "routes.schema.json"
REFERENCE_PATH = ROOT / "docs" / "configuration.md"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
CASES = ROOT / "tests" / "loader_cases"

MINIMAL: dict[str, Any] = {
    "version": 1,
    "redis": {"url": "", "mode": "standalone", "timeout": "50ms", "key_prefix": "rlgw"},
    "defaults": {"failure_mode": "open", "headers": "draft"},
    "jwt": {"algorithms": ["HS256"], "secret": "s3cret"},
    "admin": {"token": ""},
    "identity": {"body_max_bytes": 1024, "max_length": 256},
    "local_refusals": {"max_entries": 100_000, "max_hold": "1s"},
    "keys": {"source": "header:X-Api-Key", "unknown": "reject", "plans": ["free", "pro"]},
    "upstreams": {"up": {"url": "http://127.0.0.1:9000", "timeout": "1s"}},
    "routes": [{
        "name": "r",
        "match": {"path": "/items/{item}", "methods": ["GET"]},
        "upstream": "up",
        "limits": [{"name": "l", "by": ["ip"], "algorithm": "fixed_window", "limit": 5, "window": "1s"}],
    }],
}


def loader_problems(doc: dict[str, Any] | str, env: dict[str, str] | None = None, proxy: bool = True) -> list[str]:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    try:
        parse_config(text, "routes.yaml", env or {}, proxy)
    except ConfigError as exc:
        return [f"{p.key}: {p.message}" for p in exc.problems]
    return []


def schema_errors(doc: Any) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


def with_change(path: tuple[str | int, ...], value: Any, base: dict[str, Any] = MINIMAL) -> dict[str, Any]:
    """`base` with the value at `path` replaced (or added, with the sections it is in)."""
    doc = copy.deepcopy(base)
    node: Any = doc
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
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


def schema_enum(node: dict[str, Any]) -> set[str]:
    enums = [alt["enum"] for alt in node.get("anyOf", [node]) if "enum" in alt]
    assert len(enums) == 1, node
    return set(enums[0])


# --- generated files ---------------------------------------------------------------------------------

def test_schema_is_valid_draft_2020_12() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert loader_problems(MINIMAL) == []
    assert schema_errors(MINIMAL) == []


def test_checked_in_schema_is_generated_from_the_field_table() -> None:
    assert SCHEMA_PATH.read_text() == render_schema(), \
        "gateway/routes.schema.json is stale: python -m gateway.config.schema > gateway/routes.schema.json"


def test_configuration_reference_is_generated_from_the_field_table() -> None:
    assert REFERENCE_PATH.read_text() == render_reference(), \
        "docs/configuration.md is stale: python -m gateway.config.reference > docs/configuration.md"
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text(), "the README links the reference"


def test_every_key_of_the_table_is_in_the_reference_and_the_schema() -> None:
    reference = REFERENCE_PATH.read_text()
    for place in Place:
        section = reference.split(f"\n## {place.value}\n", 1)[1].split("\n## ", 1)[0]
        properties = SCHEMA["properties"] if place is Place.TOP else SCHEMA["$defs"][place.value]["properties"]
        assert list(properties) == list(keys(place)), place
        for key in keys(place):
            assert f"| `{key}` |" in section, (place, key)


# --- keys --------------------------------------------------------------------------------------

# Where an unknown key is planted, and the place whose keys the loader must list there.
KEY_LEVELS = [
    ((), Place.TOP),
    (("redis",), Place.REDIS),
    (("defaults",), Place.DEFAULTS),
    (("jwt",), Place.JWT),
    (("admin",), Place.ADMIN),
    (("identity",), Place.IDENTITY),
    (("local_refusals",), Place.LOCAL_REFUSALS),
    (("upstreams", "up"), Place.UPSTREAM),
    (("routes", 0), Place.ROUTE),
    (("routes", 0, "match"), Place.MATCH),
    (("routes", 0, "limits", 0), Place.RULE),
]


@pytest.mark.parametrize(("where", "place"), KEY_LEVELS, ids=[p.value for _, p in KEY_LEVELS])
def test_every_level_knows_the_same_keys(where: tuple[str | int, ...], place: Place) -> None:
    doc = copy.deepcopy(MINIMAL)
    node: Any = doc
    for part in where:
        node = node[part]
    node["zz_unknown"] = 1
    problems = loader_problems(doc)
    hints = [m for p in problems if (m := re.search(r"unknown key \(allowed here: ([^)]*)\)", p))]
    assert hints, problems
    assert [k.strip() for k in hints[0].group(1).split(",")] == list(keys(place))
    assert any("zz_unknown" in e for e in schema_errors(doc))
    # SPEC: any key of defaults may be set on a route too
    assert set(keys(Place.DEFAULTS)) <= set(keys(Place.ROUTE))


# --- enumerations ---------------------------------------------------------------------------------

EXAMPLE_PARAMS: dict[str, dict[str, Any]] = {
    "fixed_window": {"limit": 5, "window": "1s"},
    "sliding_window": {"limit": 5, "window": "1s"},
    "sliding_log": {"limit": 5, "window": "1m"},
    "token_bucket": {"rate": "5/s", "burst": 5},
    "gcra": {"rate": "5/s", "burst": 5},
    "leaky_bucket": {"rate": "5/s", "burst": 5},
    "quota": {"limit": 100, "period": "1d"},
    "concurrency": {"limit": 10, "lease": "30s"},
}

# Every key whose value is one of a list of choices, and where it is planted.
ENUMS = [
    (("redis", "mode"), Place.REDIS),
    (("defaults", "failure_mode"), Place.DEFAULTS),
    (("defaults", "headers"), Place.DEFAULTS),
    (("routes", 0, "failure_mode"), Place.ROUTE),
    (("routes", 0, "headers"), Place.ROUTE),
    (("defaults", "method_override"), Place.DEFAULTS),
    (("routes", 0, "method_override"), Place.ROUTE),
    (("routes", 0, "limits", 0, "algorithm"), Place.RULE),
    (("routes", 0, "limits", 0, "on_missing"), Place.RULE),
    (("jwt", "algorithms"), Place.JWT),
    (("check", "convention"), Place.CHECK),
    (("routes", 0, "match", "path_case"), Place.MATCH),
    (("routes", 0, "respond"), Place.ROUTE),
    (("keys", "unknown"), Place.KEYS),
    (("upstreams", "up", "protect", "scope"), Place.PROTECT),
]


def test_every_choice_of_the_table_is_tried_below() -> None:
    from gateway.config.fields import FIELDS

    choices = {(p, f.key) for f in FIELDS for p in f.places
               if isinstance(f.kind, Choice) or (isinstance(f.kind, ListOf) and isinstance(f.kind.item, Choice))}
    assert choices == {(place, where[-1]) for where, place in ENUMS}


@pytest.mark.parametrize(("where", "place"), ENUMS, ids=[".".join(map(str, e[0])) for e in ENUMS])
def test_every_enumeration_matches_the_loader(where: tuple[str | int, ...], place: Place) -> None:
    key = str(where[-1])
    properties = SCHEMA["properties"] if place is Place.TOP else SCHEMA["$defs"][place.value]["properties"]
    node = properties[key]
    enum = schema_enum(node["items"] if key == "algorithms" else node)
    kind = field(place, key).kind
    options = kind.item if isinstance(kind, ListOf) else kind
    assert isinstance(options, Choice)
    assert enum == set(options.options)
    bogus = ["not-a-choice"] if key == "algorithms" else "not-a-choice"
    problems = loader_problems(with_change(where, bogus))
    listed = [m for p in problems if (m := re.search(r"is not one of (.*)$", p))]
    assert listed, problems
    assert {c.strip() for c in listed[0].group(1).split(",")} == enum
    assert schema_errors(with_change(where, bogus))
    for choice in sorted(enum):
        good = with_change(where, [choice] if key == "algorithms" else choice)
        if key == "algorithms" and not choice.startswith("HS"):
            good["jwt"]["public_key"] = "-----BEGIN PUBLIC KEY-----"
        if key == "algorithm":
            good = with_change(where[:-1], {"name": "l", "by": [], "algorithm": choice, **EXAMPLE_PARAMS[choice]})
        if key == "respond":  # a route the gateway answers has no upstream
            del good["routes"][0]["upstream"]
        assert loader_problems(good) == [], choice
        assert schema_errors(good) == [], choice


def test_identity_source_kinds_match_the_loader() -> None:
    for kind in SOURCE_KINDS:
        source = kind if kind in NAMELESS_SOURCES else f"{kind}:item"
        doc = with_change(("routes", 0, "limits", 0, "by"), [source])
        if kind == "consumer":  # the consumer of the request's API key: with a keys: section
            doc["keys"] = {"source": "header:X-Api-Key", "plans": ["free"]}
        assert loader_problems(doc) == [], source
        assert schema_errors(doc) == [], source
    for bad in ("user:x", "header", "ip:x", "cookie:"):
        doc = with_change(("routes", 0, "limits", 0, "by"), [bad])
        assert loader_problems(doc), bad
        assert schema_errors(doc), bad


# --- documents ------------------------------------------------------------------------------------

def test_repo_routes_yaml_validates() -> None:
    path = ROOT / "routes.yaml"
    assert path.exists(), "the repository's example routes.yaml is referenced by the README and the image"
    doc = yaml.safe_load(path.read_text())
    assert schema_errors(doc) == []
    assert loader_problems(path.read_text()) == []


def yaml_examples() -> list[tuple[str, Any]]:
    """Every ```yaml block of the README and docs/ that is part of a routes.yaml (not Helm values)."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)):
            docs = list(yaml.safe_load_all(block))
            if len(docs) != 1:  # Kubernetes manifests (docs/envoy-rls.md: Istio, Contour)
                continue
            doc = docs[0]
            if isinstance(doc, list) or (isinstance(doc, dict) and set(doc) <= set(keys(Place.TOP))):
                out.append((f"{page.name}[{n}]", doc))
    return out


EXAMPLES = yaml_examples()
SHOP = with_change(("routes", 0, "upstream"), "shop",
                   with_change(("upstreams",), {"shop": {"url": "http://127.0.0.1:9000"}}))


def test_the_docs_hold_examples() -> None:
    assert len(EXAMPLES) >= 5, [label for label, _ in EXAMPLES]


@pytest.mark.parametrize(("label", "example"), EXAMPLES, ids=[label for label, _ in EXAMPLES])
def test_every_example_in_the_docs_validates(label: str, example: Any) -> None:
    """Complete files as they are; fragments (a list of routes, a few top-level keys) in a minimal file."""
    if isinstance(example, list):
        example = {"routes": example}
    if isinstance(example.get("rls"), dict) and example["rls"].get("files"):
        example = {**example, "rls": {**example["rls"], "files": []}}  # the files it names are not in docs/
    complete = {"version", "routes"} <= set(example)
    if complete and "upstreams" not in example:  # a file for the middleware (README: inside another app)
        assert loader_problems(example, proxy=False) == []
        return
    doc = example if complete else {**SHOP, **example}
    assert loader_problems(doc) == [], label
    assert schema_errors(doc) == [], label


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
    ("path parameter not last", with_change(("routes", 0, "match", "path"), "/{rest:path}/tail")),
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
    ("trusted proxy prefix too long", with_change(("trusted_proxies",), ["10.0.0.0/33"])),
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


# The loader_cases files whose fault a JSON schema cannot say, and why.
BEYOND_A_SCHEMA = {
    "burst_refill_too_slow": "compares two values (burst / rate)",
    "duplicate_route": "names unique across a list",
    "duplicate_rule": "names unique across a list",
    "hop_by_hop_identity": "a case-insensitive list of header names (unreadable as a pattern)",
    "impossible_cost": "compares cost with the rule's capacity",
    "jwt_without_key": "a source that depends on another section",
    "count_on_leaky_bucket": "a key forbidden with one algorithm's value",
    "refund_sliding_log": "a key forbidden with one algorithm's value",
    "match_hop_by_hop_header": "a case-insensitive list of header names (unreadable as a pattern)",
    "match_jwt_without_key": "a condition that depends on another section",
    "missing_path_param": "a source that depends on the route's path",
    "typed_path_disagrees_with_template": "a source that depends on the route's path",
    "missing_upstream": "a reference to another section",
    "shards_cost_exceeds_share": "arithmetic over the rules",
    "shards_first_rule_skips": "depends on the first rule",
    "shards_quota_smaller_than_shards": "arithmetic over the rules",
    "shards_without_identity": "depends on the first rule",
    "unset_env": "the environment",
    "websocket_on_http2": "a reference to another section (the upstream's http2)",
    "yaml_alias": "the YAML text (a schema sees the resolved document)",
    "route_after_a_catch_all": "the order of the routes",
    "method_misspelled": "a list of known methods (kept in the loader, for its did-you-mean)",
    "upstream_twice": "the YAML text (a document keeps one of two equal keys)",
    "nested_env_default": "the environment references (a schema sees them as text)",
}
NOT_YAML = {"not_yaml", "spec_unquoted_braces"}


@pytest.mark.parametrize("case", sorted(CASES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_loader_case_is_refused_by_the_schema_where_a_schema_can_say_why(case: Path) -> None:
    assert loader_problems(case.read_text(), {}), "the loader refuses every case (tests/test_loader.py)"
    if case.stem in NOT_YAML:
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(case.read_text())
        return
    refused = bool(schema_errors(yaml.safe_load(case.read_text())))
    assert refused == (case.stem not in BEYOND_A_SCHEMA), BEYOND_A_SCHEMA.get(case.stem, "the schema accepts it")


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
    "window": ["1s", "50ms", "1.5m", "15min", "2h", "1d", " 10 s ", "0.5ms", "day", "week", "month"],
    "period": ["1d", "30m", "month"],
    "calendar": ["Europe/Berlin", "UTC"],
    "lease": ["30s", "2m"],
    "rate": ["5/s", "100/min", "1000/h", "10000/d", "2/sec", "1/minute", "0.5/s", "3 / hour"],
    "burst": [1, 10, 1_000_000_000],
    "status": [400, 409, 429, 503, 599],
    "shadow": [True, False, "yes", "off"],
    "on_missing": ["reject", "skip", "ip"],
}
BAD: dict[str, list[Any]] = {
    "limit": [0, -3, 1_000_000_001, "many", True],
    "window": ["0s", "0.0ms", "10", "1w", "-1s", 5, ""],
    "period": ["0s", "forever", "Day"],
    "calendar": ["Mars/Olympus_Mons", ""],
    "lease": ["0s", "soon"],
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
    for algorithm in (*(a.value for a in ALGORITHMS), "leaky"):
        needed, optional = parameters(Algorithm(algorithm)) if algorithm in ALGORITHMS else (("limit", "window"), ())
        takes = set(needed) | set(optional)
        base: dict[str, Any] = {"name": "r", "by": ["ip"], "algorithm": algorithm}
        base.update({key: GOOD[key][0] for key in needed})
        keys = [*sorted(takes), "status", "shadow", "on_missing"]
        for key in keys:
            out += [{**base, key: value} for value in GOOD[key] + BAD[key]]
        out += [{k: v for k, v in base.items() if k != key} for key in needed]
        out += [{**base, key: GOOD[key][0]} for key in sorted(set(PARAMETERS) - takes)]
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
