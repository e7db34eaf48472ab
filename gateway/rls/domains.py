"""A rate limit service domain as served: its descriptor tree compiled for lookups, the plan of its
route (`rls.<domain>`), the RateLimit each of its rules reports (gateway/rls/service.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gateway.config import Rule
from gateway.config.model import RlsDescriptor, RlsDomain
from gateway.keying import keyed, token_of
from gateway.keys import identity_token, shard_tags, state_key
from gateway.limiter import RuleSpec, rule_spec
from gateway.overrides import RouteTable
from gateway.plan import RoutePlan
from gateway.rls import messages as pb

UNIT_CODES = {seconds: code for code, seconds in pb.UNIT_SECONDS.items()} | {30 * 86400: 5, 365 * 86400: 6}
CODE_SECONDS = {code: seconds for seconds, code in UNIT_CODES.items()}


@dataclass
class Node:
    """A level of a domain's tree, compiled for lookups."""

    exact: dict[tuple[str, str], Entry] = field(default_factory=dict)
    prefixes: list[tuple[str, str, Entry]] = field(default_factory=list)
    any_value: dict[str, Entry] = field(default_factory=dict)


@dataclass
class Entry:
    descriptor: RlsDescriptor
    below: Node


def _compile(descriptors: tuple[RlsDescriptor, ...]) -> Node:
    node = Node()
    for d in descriptors:
        entry = Entry(d, _compile(d.descriptors))
        if not d.value:
            node.any_value[d.key] = entry
        elif d.value.endswith("*"):
            node.prefixes.append((d.key, d.value[:-1], entry))
        else:
            node.exact[(d.key, d.value)] = entry
    return node


class Counted(NamedTuple):
    """One rule and key counted in the call, and the descriptors it answers for."""

    rule: Rule
    spec: RuleSpec
    key: str
    limit: Any  # RateLimitResponse.RateLimit
    configured: bool = False  # the file's rule as it is (not an override's, not a descriptor's own limit)


class Domain:
    """One domain as served: its tree, its route's plan, the RateLimit each rule reports."""

    def __init__(self, domain: RlsDomain, plan: RoutePlan) -> None:
        self.domain = domain
        self.plan = plan
        self.root = _compile(domain.descriptors)
        self.limits = [_rate_limit(rule, name) for rule, name in zip(domain.route.limits, domain.names, strict=True)]
        shards = plan.shards
        self.whole = [rule_spec(rule) for rule in plan.rules]  # a rule's spec where it holds its whole limit
        self.shares = [[rule_spec(rule, shards, s) for rule in plan.rules] for s in range(shards)] if shards > 1 \
            else [self.whole]
        # the calendar periods of its rules: the script its calls run knows each (Limiter.decide)
        self.calendars = tuple(sorted({spec.calendar for spec in self.whole if spec.calendar}))

    def counted(self, index: int, parts: list[bytes], shard: int, whole: bool,
                overrides: RouteTable | None) -> Counted | None:
        """Rule `index` for the identity `parts` in `shard`, as overridden for it; None when an
        override makes it unlimited."""
        found = keyed(self.plan, index, token_of(self.plan, index, parts), shard, overrides)
        if found.unlimited:
            return None
        if found.override is not None:  # the whole limit or a share, as the call counts this rule
            spec = rule_spec(found.rule) if whole else rule_spec(found.rule, self.plan.shards, shard)
            return Counted(found.rule, spec, found.key, self.limits[index])
        spec = (self.whole if whole else self.shares[shard])[index]
        return Counted(found.rule, spec, found.key, self.limits[index], configured=True)

    def dynamic(self, found: tuple[Rule, Any], entries: Sequence[tuple[str, str]], shard: int,
                key_prefix: str) -> Counted:
        """A descriptor's own limit, counted per descriptor (its keys and values) and number, in
        the call's shard (one hash tag for the whole call)."""
        rule, reported = found
        parts = [part.encode() for entry in entries for part in entry]
        parts.append(b"%d" % rule.limit)
        tag = shard_tags(self.plan.route.name, self.plan.shards)[shard]
        key = state_key(key_prefix, self.plan.route.name, rule.name, identity_token(parts, readable=False), tag)
        return Counted(rule, rule_spec(rule), key, reported)

    def limit_of(self, entries: Sequence[tuple[str, str]]) -> RlsDescriptor | None:
        """The descriptor entry whose rule counts a descriptor of these entries (envoyproxy/ratelimit's
        GetLimit): None when no limit is found or the request goes deeper than the tree."""
        level = self.root
        found: RlsDescriptor | None = None
        last = len(entries) - 1
        for i, (key, value) in enumerate(entries):
            entry = level.exact.get((key, value))
            if entry is None:
                entry = next((e for k, prefix, e in level.prefixes if k == key and value.startswith(prefix)), None)
            if entry is None:
                entry = level.any_value.get(key)
            if entry is None:
                return None
            d = entry.descriptor
            if i == last and (d.rule is not None or d.unlimited):
                found = d
            if not d.descriptors:
                return found
            level = entry.below
        return found


def domains_of(config_domains: tuple[RlsDomain, ...], plans: dict[str, RoutePlan]) -> dict[str, Domain]:
    return {d.name: Domain(d, plans[d.route.name]) for d in config_domains}



def _rate_limit(rule: Rule, name: str) -> Any:
    """What current_limit says of a rule: its quota per unit where its window is one, else per its
    own window (unit UNKNOWN)."""
    window = rule.policy_window
    unit = UNIT_CODES.get(int(window), 0) if window == int(window) else 0
    return pb.RateLimitResponse.RateLimit(requests_per_unit=min(rule.quota_size, 2**32 - 1), unit=unit, name=name)


