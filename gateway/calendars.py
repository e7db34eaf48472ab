"""Calendar periods: `window:` (fixed_window) and `period:` (quota) of `day`, `week` (from Monday)
or `month` (from the 1st), reset at local midnight of `calendar:` (an IANA zone, default UTC).

A zone is read from the tzdata package the gateway is installed with, never from the host's zone
files: gateways sharing a counter on hosts whose files differ (an older image, `localtime`, the
`right/` zones that count leap seconds) would otherwise reset it at different midnights. So a
`calendar` must name a zone of that package (not `localtime`, `posixrules`, `right/...`, a path,
nor `Factory`, its placeholder for an unset zone).

The script decides with Redis's clock, so the next local midnight is computed in Lua: each zone's
UTC offset changes from FIRST_YEAR to LAST_YEAR are read here once (zoneinfo) and written into the
script as a tree of comparisons
(lua/decide.lua, `calendar`). A day across a daylight-saving change is 23 or 25 hours long, and a
refusal's retry counts to the next local reset.
"""

from __future__ import annotations

import difflib
import functools
from datetime import UTC, datetime, timedelta
from importlib import resources
from zoneinfo import ZoneInfo

NOMINAL = {"day": 86_400, "week": 7 * 86_400, "month": 31 * 86_400}  # seconds; a month: the longest
KINDS = {"day": 1, "week": 2, "month": 3}
LONGEST_EXTRA = 3_600  # a local day (so week, month) may be an hour longer: daylight saving's end
FIRST_YEAR, LAST_YEAR = 2000, 2100
STEP = 7 * 86_400  # offsets are sampled weekly, then each change found to the second


class Period(str):
    """A `window:` or `period:` that names a calendar period rather than a duration."""

    __slots__ = ()


# the shape of a zone's name, not one the host alone has (for the JSON schema; zone_problem decides)
ZONE_SHAPE = r"^(?!(localtime|posixrules|Factory)$|(posix|right)/)[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,2}$"


@functools.lru_cache(maxsize=1)
def zone_names() -> frozenset[str]:
    """The zones of the tzdata package."""
    return frozenset(resources.files("tzdata").joinpath("zones").read_text("utf-8").split())


def zone_problem(name: str) -> str | None:
    """Why `name` is no time zone every host reads alike, or None."""
    if name == "localtime":
        return ("'localtime' is the host's own zone: gateways on hosts in other zones would reset one counter at "
                "different midnights; name the zone (Europe/Berlin, America/New_York, UTC)")
    if name == "Factory":
        return "'Factory' is tzdata's placeholder for a zone not set; name the zone (Europe/Berlin, UTC)"
    if name not in zone_names():
        wanted = name.removeprefix("posix/").removeprefix("right/").lower()
        near = [z for z in zone_names() if z.lower() == wanted] or difflib.get_close_matches(
            wanted, sorted(zone_names(), key=str.lower), n=1)
        hint = f"did you mean {near[0]}?" if near else "Europe/Berlin, America/New_York, UTC"
        return f"{name!r} is no IANA time zone ({hint})"
    return None


@functools.lru_cache(maxsize=64)
def zone(name: str) -> ZoneInfo:
    """The zone as the tzdata package has it, whatever the host's zone files say."""
    with resources.files("tzdata.zoneinfo").joinpath(*name.split("/")).open("rb") as data:
        return ZoneInfo.from_file(data, key=name)


@functools.lru_cache(maxsize=64)
def transitions(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The zone's offset changes (UTC seconds) and its offsets (seconds): the one before the first
    change, then the one from each change on."""
    tz = zone(name)

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


def offset_tree(name: str) -> str:
    """The body of the script's cal_off(s): the zone's offset at UTC second s, by binary search
    written out as nested ifs (no table is built per call)."""
    times, offsets = transitions(name)

    def tree(low: int, high: int, depth: int) -> list[str]:
        # offsets[low..high] (inclusive): offsets[k] holds from times[k - 1] on
        pad = "  " * depth
        if low == high:
            return [f"{pad}return {offsets[low]}"]
        middle = (low + high + 1) // 2
        return [f"{pad}if s < {times[middle - 1]} then", *tree(low, middle - 1, depth + 1), f"{pad}else",
                *tree(middle, high, depth + 1), f"{pad}end"]

    return "\n".join(tree(0, len(offsets) - 1, 1))


def next_reset(period: str, name: str, at: float) -> float:
    """The next local reset after `at` (UTC seconds), as zoneinfo has it: what the script computes."""
    tz = zone(name)
    local = datetime.fromtimestamp(at, tz)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if period == "day":
        start = day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday()) + timedelta(days=7)
    else:
        start = (day.replace(day=1) + timedelta(days=32)).replace(day=1)
    return start.replace(tzinfo=tz).timestamp()
