"""Durations and rates as SPEC section 2 writes them: a duration's unit is ms, s, m or min, h, d."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.units import parse_duration, parse_rate

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "gateway" / "routes.schema.json").read_text())


@pytest.mark.parametrize(("text", "seconds"), [
    ("50ms", 0.05), ("1.5s", 1.5), ("5m", 300.0), ("15min", 900.0), ("15 min", 900.0), ("0.5min", 30.0),
    ("2h", 7200.0), ("1d", 86400.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["15mins", "15minute", "15 minutes", "1mn", "0min", "min", "15 m s"])
def test_durations_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|longer than zero"):
        parse_duration(text)


def test_a_window_in_min_is_accepted_like_a_rate_per_min(tmp_path: Path) -> None:
    """`rate: 5/min` was accepted while `window: 15min` was refused (issue 23)."""
    assert parse_rate("5/min") * parse_duration("15min") == pytest.approx(75)  # the same minute
    doc: dict[str, Any] = {"version": 1, "upstreams": {"up": {"url": "http://127.0.0.1:9000"}},
           "routes": [{"name": "login", "match": {"path": "/login"}, "upstream": "up", "limits": [
               {"name": "ip", "by": ["ip"], "algorithm": "sliding_log", "limit": 5, "window": "15min"},
               {"name": "g", "by": [], "algorithm": "gcra", "rate": "5/min", "burst": 5}]}]}
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(doc))
    checked = subprocess.run([sys.executable, "-m", "gateway", "check", str(path)], capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
    assert checked.returncode == 0, checked.stderr
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)  # editors agree with the loader
    zero = copy.deepcopy(doc)
    zero["routes"][0]["limits"][0]["window"] = "0min"
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(zero)
