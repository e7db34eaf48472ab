"""routes.yaml: the field table (fields.py), the frozen objects it becomes (model.py), the loader
(loader.py), and the JSON schema and docs table generated from the table (schema.py, reference.py)."""

from gateway.config.fields import (
    ALGORITHMS,
    BUCKET_ALGORITHMS,
    FAILURE_MODES,
    HEADER_MODES,
    MAX_COST,
    MAX_RULES,
    MAX_SHARDS,
    MAX_SPAN,
    MIN_WINDOW,
    ON_MISSING,
    OPTIONAL_FOR,
    PARAMS_FOR,
    REDIS_MODES,
    WINDOW_ALGORITHMS,
    Algorithm,
    Field,
    Place,
)
from gateway.config.kinds import ENV_REF, NAME, PARAM, SOURCE_KINDS, path_params
from gateway.config.loader import load_config, parse_config
from gateway.config.model import (
    LOCAL_REFUSALS_HOLD,
    LOCAL_REFUSALS_MAX,
    Conditions,
    Config,
    JwtSettings,
    KeysSettings,
    Priority,
    Protect,
    RedisSettings,
    Route,
    Rule,
    Source,
    Upstream,
    UpstreamTls,
    keeps_full_limit,
    shard_share,
)
from gateway.config.rules import UNREADABLE_HEADERS

__all__ = [
    "ALGORITHMS", "BUCKET_ALGORITHMS", "ENV_REF", "FAILURE_MODES", "HEADER_MODES", "LOCAL_REFUSALS_HOLD",
    "LOCAL_REFUSALS_MAX", "MAX_COST", "MAX_RULES", "MAX_SHARDS", "MAX_SPAN", "MIN_WINDOW", "NAME", "ON_MISSING",
    "OPTIONAL_FOR", "PARAM", "PARAMS_FOR", "REDIS_MODES", "SOURCE_KINDS", "UNREADABLE_HEADERS", "WINDOW_ALGORITHMS",
    "Algorithm", "Conditions", "Config", "Field", "JwtSettings", "KeysSettings", "Place", "Priority", "Protect",
    "RedisSettings", "Route", "Rule", "Source",
    "Upstream", "UpstreamTls", "keeps_full_limit", "load_config", "parse_config", "path_params", "shard_share",
]
