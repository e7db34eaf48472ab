"""Calendar periods: `window:` (fixed_window) and `period:` (quota) of `day`, `week` (from Monday)
or `month` (from the 1st), reset at local midnight of `calendar:` (an IANA zone, default UTC).

The script decides with Redis's clock, so the next local midnight is computed in Lua: each zone's
UTC offset changes from FIRST_YEAR to LAST_YEAR are read here once (zoneinfo, with the tzdata
package where the system has no zone files) and written into the script as a tree of comparisons
(lua/decide.lua, `calendar`). A day across a daylight-saving change is 23 or 25 hours long, and a
refusal's retry counts to the next local reset.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

NOMINAL = {"day": 86_400, "week": 7 * 86_400, "month": 31 * 86_400}  # seconds; a month: the longest
KINDS = {"day": 1, "week": 2, "month": 3}
LONGEST_EXTRA = 3_600  # a local day (so week, month) may be an hour longer: daylight saving's end
FIRST_YEAR, LAST_YEAR = 2000, 2100
STEP = 7 * 86_400  # offsets are sampled weekly, then each change found to the second


class Period(str):
    """A `window:` or `period:` that names a calendar period rather than a duration."""

    __slots__ = ()


def zone_problem(name: str) -> str | None:
    """Why `name` is no time zone, or None."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return f"{name!r} is no IANA time zone (Europe/Berlin, America/New_York, UTC)"
    return None


@functools.lru_cache(maxsize=64)
def transitions(zone: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The zone's offset changes (UTC seconds) and its offsets (seconds): the one before the first
    change, then the one from each change on."""
    tz = ZoneInfo(zone)

    def offset(at: int) -> int:
        delta = datetime.fromtimestamp(at, tz).utcoffset() or timedelta(0)
        return int(delta.total_seconds())

    start = int(datetime(FIRST_YEAR, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(LAST_YEAR, 1, 1, tzinfo=UTC).timestamp())
    times: list[int] = []
    offsets = [offset(start)]
    at = start
    while at < end:
        following = at + STEP
        now = offset(following)
        if now != offsets[-1]:
            low, high = at, following  # offset(low) is the old one, offset(high) the new
            while high - low > 1:
                middle = (low + high) // 2
                if offset(middle) == offsets[-1]:
                    low = middle
                else:
                    high = middle
            times.append(high)
            offsets.append(offset(high))
        at = following
    return tuple(times), tuple(offsets)


def offset_tree(zone: str) -> str:
    """The body of the script's cal_off(s): the zone's offset at UTC second s, by binary search
    written out as nested ifs (no table is built per call)."""
    times, offsets = transitions(zone)

    def tree(low: int, high: int, depth: int) -> list[str]:
        # offsets[low..high] (inclusive): offsets[k] holds from times[k - 1] on
        pad = "  " * depth
        if low == high:
            return [f"{pad}return {offsets[low]}"]
        middle = (low + high + 1) // 2
        return [f"{pad}if s < {times[middle - 1]} then", *tree(low, middle - 1, depth + 1), f"{pad}else",
                *tree(middle, high, depth + 1), f"{pad}end"]

    return "\n".join(tree(0, len(offsets) - 1, 1))


def next_reset(period: str, zone: str, at: float) -> float:
    """The next local reset after `at` (UTC seconds), as zoneinfo has it: what the script computes."""
    tz = ZoneInfo(zone)
    local = datetime.fromtimestamp(at, tz)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if period == "day":
        start = day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday()) + timedelta(days=7)
    else:
        start = (day.replace(day=1) + timedelta(days=32)).replace(day=1)
    return start.replace(tzinfo=tz).timestamp()
