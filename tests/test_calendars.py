"""Calendar periods (gateway/calendars.py, issue 30): `window:`/`period:` of day, week or month,
reset at local midnight of `calendar: TZ`, decided with Redis's clock. The script's next reset is
checked against zoneinfo over a century and several zones; then a real gateway on a Redis whose clock
the test moves across a month end and both daylight-saving days."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.calendars import KINDS, next_reset, offset_tree
from gateway.config import parse_config
from gateway.decision_script import FRAGMENTS, rule_spec
from gateway.errors import ConfigError
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisClock, RedisProcess
from tests.support.upstream import Upstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

# no DST; DST at 02:00/03:00 (Europe), at 02:00 local (America), half an hour (Lord Howe), south;
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "Australia/Sydney",
         "America/Sao_Paulo", "America/Santiago", "Pacific/Apia"]  # the last: DST at midnight, a skipped day


def _berlin(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return datetime(year, month, day, hour, minute, second, tzinfo=ZoneInfo("Europe/Berlin")).timestamp()


def _lua_next(client: redis.Redis, period: str, zone: str, at_us: int) -> int:
    source = FRAGMENTS["calendar"].substitute(c=0, kind=KINDS[period], offsets=offset_tree(zone))
    return int(client.eval(source + "return cal_next0(tonumber(ARGV[1]))", 0, at_us))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ZONES), st.sampled_from(list(KINDS)),
       st.integers(int(datetime(2000, 1, 2, tzinfo=UTC).timestamp()),
                   int(datetime(2099, 12, 1, tzinfo=UTC).timestamp())))
def test_the_scripts_next_reset_is_zoneinfos(redis_proc: RedisProcess, zone: str, period: str, at: int) -> None:
    client = redis_proc.client()
    assert _lua_next(client, period, zone, at * 1_000_000 + 123) == next_reset(period, zone, at + 0.000123) * 1_000_000


def test_daylight_saving_days_are_23_and_25_hours_and_months_end_on_the_1st(redis_proc: RedisProcess) -> None:
    client = redis_proc.client()
    def local(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> int:
        return round(_berlin(year, month, day, hour, minute)) * 1_000_000

    spring = local(2026, 3, 29, 0, 30)     # clocks go from 02:00 to 03:00 that night
    assert _lua_next(client, "day", "Europe/Berlin", spring) - spring == (23 * 3600 - 1800) * 1_000_000
    autumn = local(2026, 10, 25, 0, 30)    # 03:00 back to 02:00
    assert _lua_next(client, "day", "Europe/Berlin", autumn) - autumn == (25 * 3600 - 1800) * 1_000_000
    assert _lua_next(client, "month", "Europe/Berlin", local(2026, 1, 31, 23, 59)) == local(2026, 2, 1)
    assert _lua_next(client, "month", "Europe/Berlin", local(2028, 2, 28, 12)) == local(2028, 3, 1)  # a leap year
    assert _lua_next(client, "month", "Europe/Berlin", local(2026, 12, 31, 23)) == local(2027, 1, 1)
    assert _lua_next(client, "week", "Europe/Berlin", local(2026, 11, 29, 23)) == local(2026, 11, 30)  # Sunday
    assert _lua_next(client, "week", "Europe/Berlin", local(2026, 11, 30)) == local(2026, 12, 7)      # Monday


def test_calendar_periods_in_the_file() -> None:
    config = parse_config(textwrap.dedent("""\
        version: 1
        upstreams: {up: {url: "http://u:1"}}
        routes:
          - name: r
            match: {path: /r}
            upstream: up
            limits:
              - {name: month, by: [ip], algorithm: quota, limit: 1000, period: month, calendar: Europe/Berlin}
              - {name: day, by: [ip], algorithm: fixed_window, limit: 100, window: day}
        """), "routes.yaml", {})
    month, day = config.routes[0].limits
    assert (month.calendar_period, month.calendar, day.calendar_period, day.calendar) == \
        ("month", "Europe/Berlin", "day", "UTC")
    assert rule_spec(month).calendar == "month@Europe/Berlin" and rule_spec(day).calendar == "day@UTC"
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent("""\
            version: 1
            upstreams: {up: {url: "http://u:1"}}
            routes:
              - name: r
                match: {path: /r}
                upstream: up
                limits:
                  - {name: a, by: [ip], algorithm: sliding_window, limit: 5, window: day}
                  - {name: b, by: [ip], algorithm: fixed_window, limit: 5, window: 1h, calendar: Europe/Berlin}
                  - {name: c, by: [ip], algorithm: quota, limit: 5, period: month, calendar: Europe/Berln}
            """), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":8: routes[0](r).limits[0](a).window: day is a calendar period: fixed_window and quota take one"
               in s for s in shown), shown
    assert any(":9: routes[0](r).limits[1](b).calendar: goes with a window of day, week or month" in s
               for s in shown), shown
    assert any(":10: routes[0](r).limits[2](c).calendar: 'Europe/Berln' is no IANA time zone" in s
               for s in shown), shown


def test_an_override_of_a_calendar_rule_keeps_its_period_and_zone() -> None:
    from gateway.overrides import OverrideInvalid, parse_override

    config = parse_config(textwrap.dedent("""\
        version: 1
        upstreams: {up: {url: "http://u:1"}}
        routes:
          - name: r
            match: {path: /r}
            upstream: up
            limits: [{name: month, by: [ip], algorithm: quota, limit: 10, period: month, calendar: Europe/Berlin}]
        """), "routes.yaml", {})
    rule = config.routes[0].limits[0]
    more = parse_override(rule, {"limit": 50})
    assert more is not None and rule_spec(more).calendar == "month@Europe/Berlin" and more.limit == 50
    same = parse_override(rule, {"limit": 50, "period": "month"})
    assert same is not None and rule_spec(same) == rule_spec(more)
    for body in ({"limit": 5, "period": "1d"}, {"limit": 5, "period": "week"}, {"limit": 5, "calendar": "UTC"}):
        with pytest.raises(OverrideInvalid):
            parse_override(rule, body)


# --- end to end: a real gateway, Redis's clock moved ---------------------------------------------

CONFIG = """
version: 1
redis: {{timeout: 2s, key_prefix: {prefix}}}
local_refusals: {{max_entries: 0}}
defaults: {{headers: both}}
upstreams: {{up: {{url: "{upstream}"}}}}
routes:
  - name: monthly
    match: {{path: /echo/monthly}}
    upstream: up
    limits:
      - {{name: month, by: ["header:X-Api-Key"], algorithm: quota, limit: 3, period: month, calendar: Europe/Berlin}}
  - name: daily
    match: {{path: /echo/daily}}
    upstream: up
    limits:
      - {{name: day, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 2, window: day,
          calendar: Europe/Berlin}}
"""


@pytest.fixture
def clocked(tmp_path: Path, clocked_redis: tuple[RedisProcess, RedisClock], upstream: Upstream
            ) -> tuple[GatewayProcess, RedisClock]:
    proc, clock = clocked_redis
    gateway = GatewayProcess(CONFIG.format(prefix=f"k{uuid.uuid4().hex[:8]}", upstream=upstream.url), tmp_path,
                             redis_url=proc.url)
    gateway.start()
    return gateway, clock


def test_a_monthly_quota_resets_on_the_1st_at_local_midnight(clocked: tuple[GatewayProcess, RedisClock]) -> None:
    gateway, clock = clocked
    key = {"X-Api-Key": "m-" + uuid.uuid4().hex}
    try:
        clock.set(_berlin(2027, 1, 31, 23, 58, 30))
        with httpx.Client(base_url=gateway.url) as client:
            assert [client.get("/echo/monthly", headers=key).status_code for _ in range(4)] == [200, 200, 200, 429]
            refused = client.get("/echo/monthly", headers=key)
            assert refused.headers["retry-after"] == "90"  # to 1 February, 00:00 in Berlin (23:00 UTC)
            clock.set(_berlin(2027, 1, 31, 23, 59, 59))
            assert client.get("/echo/monthly", headers=key).status_code == 429
            clock.set(_berlin(2027, 2, 1, 0, 0, 0))
            assert client.get("/echo/monthly", headers=key).status_code == 200
            assert client.get("/echo/monthly", headers=key).headers["ratelimit"].startswith('"month";r=1;t=')
    finally:
        assert gateway.stop() == 0


@pytest.mark.parametrize(("day", "hours"), [((2027, 3, 28), 23), ((2027, 10, 31), 25), ((2027, 6, 1), 24)])
def test_a_daylight_saving_day_is_23_or_25_hours_and_retry_after_counts_to_local_midnight(
        clocked: tuple[GatewayProcess, RedisClock], day: tuple[int, int, int], hours: int) -> None:
    gateway, clock = clocked
    key = {"X-Api-Key": "d-" + uuid.uuid4().hex}
    try:
        clock.set(_berlin(*day, 0, 0, 10))
        with httpx.Client(base_url=gateway.url) as client:
            assert [client.get("/echo/daily", headers=key).status_code for _ in range(3)] == [200, 200, 429]
            refused = client.get("/echo/daily", headers=key)
            assert refused.headers["retry-after"] == str(hours * 3600 - 10)
            clock.advance(hours * 3600 - 11)  # the day's last second
            assert client.get("/echo/daily", headers=key).status_code == 429
            clock.advance(1)                  # local midnight
            assert client.get("/echo/daily", headers=key).status_code == 200
    finally:
        assert gateway.stop() == 0


@pytest.mark.parametrize(("zone", "why"), [
    ("localtime", "is the host's own zone"), ("posixrules", "is no IANA time zone"),
    ("right/UTC", "is no IANA time zone"), ("posix/Europe/Berlin", "is no IANA time zone"),
    ("Factory", "placeholder"), ("/etc/localtime", "is no IANA time zone"),
    ("utc", "is no IANA time zone (did you mean UTC?)")])
def test_a_calendar_names_a_zone_every_host_reads_alike(zone: str, why: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(textwrap.dedent(f"""\
            version: 1
            upstreams: {{up: {{url: "http://u:1"}}}}
            routes:
              - name: r
                match: {{path: /r}}
                upstream: up
                limits:
                  - {{name: d, by: [ip], algorithm: quota, limit: 5, period: day, calendar: "{zone}"}}
            """), "routes.yaml", {})
    shown = [str(p) for p in raised.value.problems]
    assert any(":8: routes[0](r).limits[0](d).calendar: " in s and why in s for s in shown), shown


def test_a_zone_resets_at_the_same_midnight_whatever_the_hosts_zone_files_say(tmp_path: Path) -> None:
    # a host whose zone files hold other rules for Europe/Berlin (here Tokyo's: an old or broken
    # image) computes the midnights every other gateway computes: the zones come with the gateway
    (tmp_path / "Europe").mkdir()
    (tmp_path / "Europe" / "Berlin").write_bytes(tzdata_file("Asia/Tokyo"))
    code = ("from gateway.calendars import next_reset, offset_tree; "
            "print(next_reset('day', 'Europe/Berlin', 1790000000.0)); print(offset_tree('Europe/Berlin'))")
    there = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONTZPATH": str(tmp_path)},
                           capture_output=True, text=True, check=True).stdout
    assert there == f"{next_reset('day', 'Europe/Berlin', 1790000000.0)}\n{offset_tree('Europe/Berlin')}\n"
    assert there.startswith(f"{_berlin(2026, 9, 22)}\n")


def tzdata_file(name: str) -> bytes:
    return resources.files("tzdata.zoneinfo").joinpath(*name.split("/")).read_bytes()
