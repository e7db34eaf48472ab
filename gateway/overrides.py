"""Per-identity overrides at runtime: one rule's numbers replaced for one identity.

An override is the rule's own parameters (`{"rate": "100/s", "burst": 200}`,
`{"limit": 5000, "window": "1h"}`), validated as the file's are, or `{"unlimited": true}`: that rule
sits out for the identity, as with `on_missing: skip`. Parameters the body leaves out that the
algorithm takes as optional (a quota's period) keep the file's.

Stored in Redis, in the route's hash tag (so one Cluster slot holds a route's overrides):

    <prefix>:{<route>}:<rule>:~overrides        hash: identity token -> parameters (JSON)
    <prefix>:{<route>}:<rule>:~changes          list: the identities of the last changes (1000)
    <prefix>:{<route>}:~overrides:versions      hash: rule -> a counter bumped by every change
    <prefix>:~overrides:routes                  set: routes that have had overrides

No identity token is `~overrides` or `~changes` (gateway.keys: a token is readable characters, `~` alone, or
`~` and 20 more), so these never meet a rule's state. Each worker polls the versions of its
routes every second (one HGETALL per route, batched into one round trip); of a rule whose version
changed it reads only the overrides changed since the version it holds (one script call), or, when
more changed than the list keeps, the whole hash again (HSCAN): every gateway applies a change
within about 2 s, whatever the number of overrides. A worker
keeps the stored text of every override of its routes, so a reload rebuilds the table at once;
a start reads them all before serving. A rule's overrides are bounded by its `max_overrides`
(default 100000). Rules and routes no longer in the file lose their overrides when a gateway
starts or reloads with that file.

A request whose identity has an override is decided in the route's one script call with the
overridden numbers as ARGV (gateway/decision_script.py); every other request takes the file's
script, unchanged. On a sharded route, a rule split over the shards has its override split the
same way (gateway/config: `shard_share`). When overrides change, the worker's refusals held in
memory (gateway/refusals.py), and the requests they were held for (gateway/repeats.py), are
dropped: none answers with the old numbers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.calendars import Period
from gateway.config import BUCKET_ALGORITHMS, MAX_SPAN, MIN_WINDOW, Algorithm, Config, Place, Rule, shard_share
from gateway.config.fields import SLIDING_LOG_MAX, parameters
from gateway.config.fields import field as config_field
from gateway.config.kinds import Scalar
from gateway.keys import state_key
from gateway.limiter import RuleSpec, rule_spec
from gateway.scripts import Script

if TYPE_CHECKING:
    from gateway.limiter import Limiter
    from gateway.plan import RoutePlan

log = logging.getLogger("gateway.overrides")

SYNC_INTERVAL = 1.0  # seconds between two reads of the change signal
FULL_SYNC_INTERVAL = 30.0  # seconds between two polls of every route's versions, whatever the signal says
PAGE = 1000          # fields asked per HSCAN when a rule's overrides are read
CHANGES = 1000       # changes each rule keeps listed, for workers to read only what changed
MAX_BODY = 4096      # bytes of a PUT body
SUFFIX = "~overrides"

PUT = Script("overrides_put")
DELETE = Script("overrides_delete")
DROP = Script("overrides_drop")
CHANGED = Script("overrides_changes")
COMMAND = Script("command")


# parameters an override may not set, and why
FILE_ONLY = {"lease": "is the file's for every identity: gateways renew leases by it (lua/leases.lua)",
             "calendar": "is the file's for every identity: a calendar period's time zone"}


class OverrideInvalid(ValueError):
    """A body that is not a valid override of its rule; `field` names the parameter at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def parse_override(rule: Rule, body: Any) -> Rule | None:
    """`rule` with the numbers of `body` (a decoded JSON object), or None for `{"unlimited": true}`.
    Raises OverrideInvalid."""
    if not isinstance(body, dict):
        raise OverrideInvalid("", 'the body must be a JSON object of the rule\'s parameters, or {"unlimited": true}')
    if "unlimited" in body:
        if len(body) != 1 or body["unlimited"] is not True:  # (1 == True to Python, not to JSON)
            raise OverrideInvalid("unlimited", "must be true, and alone in the body")
        return None
    algorithm = Algorithm(rule.algorithm)
    needed, optional = parameters(algorithm)
    takes = needed + optional
    for key in body:
        if key not in takes:
            raise OverrideInvalid(str(key)[:64], f"is not a parameter of {algorithm} (it takes {', '.join(takes)})")
        if key in FILE_ONLY:
            raise OverrideInvalid(key, FILE_ONLY[key])
    for key in needed:
        if key not in body:
            raise OverrideInvalid(key, f"is required by {algorithm}")
    values: dict[str, Any] = {}
    for key, value in body.items():
        spec = config_field(Place.RULE, key)
        kind = spec.kind
        assert isinstance(kind, Scalar), kind
        text = value if isinstance(value, str) else json.dumps(value)
        try:
            values[spec.name] = kind.parse(text)
        except ValueError as exc:
            raise OverrideInvalid(key, f"must be {kind.noun}: {exc}" if kind.noun else str(exc)) from None
        if spec.name == "window" and (rule.calendar_period is not None or isinstance(values["window"], Period)):
            if values["window"] != rule.calendar_period:  # the script's shape: a period of the file's kind
                raise OverrideInvalid(key, f"must be the file's: {rule.calendar_period or 'a duration'}")
            values["window"] = rule.window
    new = replace(rule, **values)
    if new.algorithm == Algorithm.SLIDING_LOG and new.limit > SLIDING_LOG_MAX:
        raise OverrideInvalid("limit", f"sliding_log keeps one entry per request; use at most {SLIDING_LOG_MAX}")
    if new.window and not MIN_WINDOW <= new.window <= MAX_SPAN:
        raise OverrideInvalid("period" if new.algorithm == Algorithm.QUOTA else "window",
                              "must be from 1ms to 100 years")
    if new.algorithm in BUCKET_ALGORITHMS and new.burst / new.rate > MAX_SPAN:
        raise OverrideInvalid("rate", "refills the burst too slowly: burst / rate must be at most 100 years")
    if new.cost > new.capacity:
        size = "burst" if new.algorithm in BUCKET_ALGORITHMS else "limit"
        raise OverrideInvalid(size, f"the rule's cost {new.cost} can never fit: it would hold at most {new.capacity}")
    return new


def check_shards(plan: RoutePlan, index: int, rule: Rule) -> None:
    """A rule split over a sharded route's shards needs a share of at least 1 (and of its cost) in
    each, as the loader asks of the file's (gateway/config/loader.py)."""
    shards = plan.shards
    if shards == 1 or not plan.route.split[index]:
        return
    size = "burst" if rule.algorithm in BUCKET_ALGORITHMS else "limit"
    total = rule.quota_size
    if total < shards:
        raise OverrideInvalid(size, f"{size} {total} is split over the route's {shards} shards; "
                                    f"each needs at least 1")
    smallest = shard_share(total, shards, shards - 1) + (1 if rule.algorithm == Algorithm.LEAKY_BUCKET else 0)
    if rule.cost > smallest:
        raise OverrideInvalid(size, f"the rule's cost {rule.cost} can never fit a shard's share ({smallest} of "
                                    f"{size} {total} over {shards} shards)")


def canonical(body: Mapping[str, Any]) -> str:
    """The stored text of a valid override's body."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


class Entry(NamedTuple):
    """One identity's override of one rule, as the pipeline applies it."""

    rule: Rule | None              # the rule with the override's numbers; None: unlimited (sits out)
    specs: tuple[RuleSpec, ...]    # per shard of the route: the spec run, `base` the file's


RouteTable = dict[int, dict[str, Entry]]  # rule index -> identity token -> override


def entry(plan: RoutePlan, index: int, text: str) -> Entry:
    """The Entry of a stored override on `plan`'s rule `index`. Raises OverrideInvalid or ValueError
    when the file's rule no longer takes it (its algorithm changed, say)."""
    file_rule = plan.rules[index]
    rule = parse_override(file_rule, json.loads(text))
    if rule is None:
        return Entry(None, ())
    check_shards(plan, index, rule)
    split = plan.route.split[index]
    specs = []
    for shard in range(plan.shards):
        spec = rule_spec(rule, plan.shards, shard) if split else rule_spec(rule)
        specs.append(spec._replace(base=plan.shard_args[shard][index]))
    return Entry(rule, tuple(specs))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Store:
    """The overrides in Redis, through the limiter's runner (scripts only: gateway.limiter)."""

    def __init__(self, limiter: Limiter, prefix: str) -> None:
        self.limiter = limiter
        self.prefix = prefix

    def hash_key(self, route: str, rule: str) -> str:
        return state_key(self.prefix, route, rule, SUFFIX)

    def changes_key(self, route: str, rule: str) -> str:
        return state_key(self.prefix, route, rule, "~changes")

    def _keys(self, route: str, rule: str) -> list[str]:
        return [self.hash_key(route, rule), self.versions_key(route), self.changes_key(route, rule)]

    def versions_key(self, route: str) -> str:
        return state_key(self.prefix, route, SUFFIX, "versions")

    @property
    def routes_key(self) -> str:
        return f"{self.prefix}:{SUFFIX}:routes"

    @property
    def signal_key(self) -> str:
        """The deployment's change signal: a counter every write of an override bumps, so a worker
        at rest reads one key a second, not the versions of every route (docs/scaling.md)."""
        return f"{self.prefix}:{{~signal}}:overrides"

    async def signal(self) -> int:
        value = await self._command(self.signal_key, "GET")
        return int(value) if value is not None else 0

    async def changed(self) -> None:
        """Bump the change signal: after a write of an override or an API key."""
        await self._command(self.signal_key, "INCR")

    async def _command(self, key: str, *args: str | int) -> Any:
        return await self.limiter.run_script(COMMAND, [key], list(args))

    async def put(self, route: str, rule: str, token: str, text: str, most: int) -> bool:
        """Store it; False when the rule holds `most` overrides already (and not this identity's)."""
        version = await self.limiter.run_script(PUT, self._keys(route, rule), [token, text, most, rule, CHANGES])
        if version == -1:
            return False
        await self._command(self.routes_key, "SADD", route)
        await self.changed()
        return True

    async def delete(self, route: str, rule: str, token: str) -> bool:
        found = await self.limiter.run_script(DELETE, self._keys(route, rule), [token, rule, CHANGES])
        if found:
            await self.changed()
        return bool(found)

    async def get(self, route: str, rule: str, token: str) -> str | None:
        value = await self._command(self.hash_key(route, rule), "HGET", token)
        return None if value is None else _text(value)

    async def count(self, route: str, rule: str) -> int:
        return int(await self._command(self.hash_key(route, rule), "HLEN"))

    async def page(self, route: str, rule: str, cursor: str, count: int) -> tuple[str, list[tuple[str, str]]]:
        """One HSCAN step: the next cursor ("0" at the end) and about `count` (token, text) pairs."""
        reply = await self._command(self.hash_key(route, rule), "HSCAN", cursor, "COUNT", count)
        nxt, flat = _text(reply[0]), reply[1]
        return nxt, [(_text(flat[j]), _text(flat[j + 1])) for j in range(0, len(flat), 2)]

    async def read_all(self, route: str, rule: str) -> dict[str, str]:
        out: dict[str, str] = {}
        cursor = "0"
        while True:
            cursor, pairs = await self.page(route, rule, cursor, PAGE)
            out.update(pairs)
            if cursor == "0":
                return out

    async def changes(self, route: str, rule: str, since: int) -> tuple[int, dict[str, str | None] | None]:
        """The rule's version, and each identity whose override changed since version `since` with
        its parameters now (None: removed); None instead when they are no longer all listed."""
        reply = await self.limiter.run_script(
            CHANGED, [self.hash_key(route, rule), self.changes_key(route, rule), self.versions_key(route)],
            [rule, since])
        version, listed, flat = int(reply[0]), int(reply[1]), reply[2:]
        if not listed:
            return version, None
        return version, {_text(flat[j]): None if flat[j + 1] is None else _text(flat[j + 1])
                         for j in range(0, len(flat), 2)}

    async def versions(self, route: str) -> dict[str, int]:
        flat = await self._command(self.versions_key(route), "HGETALL")
        return {_text(flat[j]): int(flat[j + 1]) for j in range(0, len(flat), 2)}

    async def drop_removed(self, config: Config) -> int:
        """Drop the overrides of rules and routes that `config` no longer has; how many."""
        dropped = 0
        current = {route.name: {rule.name for rule in route.limits} for route in config.limited_routes}
        known = {_text(name) for name in await self._command(self.routes_key, "SMEMBERS")}
        for route in sorted(known | set(current)):
            rules = current.get(route)
            gone = [name for name in await self.versions(route) if rules is None or name not in rules]
            doomed = [key for r in gone for key in (self.hash_key(route, r), self.changes_key(route, r))]
            if rules is None:
                dropped += await self.limiter.run_script(DROP, [self.versions_key(route), *doomed], [])
                await self._command(self.routes_key, "SREM", route)
            elif gone:
                dropped += await self.limiter.run_script(DROP, [self.versions_key(route), *doomed], gone)
        if dropped:
            await self.changed()
        return int(dropped)


def overridden(table: RouteTable | None, index: int, token: str) -> Entry | None:
    """The override of rule `index` for the identity `token`, if any."""
    if not table:
        return None
    mine = table.get(index)
    return mine.get(token) if mine else None


__all__ = ["Entry", "OverrideInvalid", "RouteTable", "Store", "canonical", "check_shards", "entry", "overridden",
           "parse_override"]
