"""Durations and rates as written in routes.yaml."""

from __future__ import annotations

import re

# ASCII digits: \d takes any script's (Arabic-Indic 1 and 0 and "s" were ten seconds), as whole numbers do not
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|min|m|h|d)\s*$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|sec|second|min|minute|m|h|hour|d|day)\s*$")

_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_PER = {
    "s": 1.0, "sec": 1.0, "second": 1.0,
    "min": 60.0, "minute": 60.0, "m": 60.0,
    "h": 3600.0, "hour": 3600.0,
    "d": 86400.0, "day": 86400.0,
}


def parse_duration(text: str) -> float:
    """'50ms' -> 0.05 (seconds). Raises ValueError."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration (use e.g. 50ms, 1s, 5m or 5min, 1h, 1d)")
    value = float(match.group(1)) * _SECONDS[match.group(2)]
    if value <= 0:
        raise ValueError(f"{text!r} must be longer than zero")
    return value


def parse_rate(text: str) -> float:
    """'5/s' -> 5.0, '120/min' -> 2.0 (per second). Raises ValueError."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a rate (use e.g. 5/s, 100/min, 1000/h, 10000/d)")
    value = float(match.group(1)) / _PER[match.group(2)]
    if value <= 0:
        raise ValueError(f"{text!r} must be more than zero")
    return value
