"""A route's plan: its rules as the limiter runs them (specs, key prefixes, shards), built once per
configuration. Shared by the pipeline, settlement, overrides and the admin port; it knows nothing
of a Runtime."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import Route, Rule
from gateway.keys import SHARED_TAG, KeyForm, canonical_parts, key_form, rule_segment, shard_of, shard_tags, state_key
from gateway.limiter import RuleSpec, rule_spec

if TYPE_CHECKING:
    from gateway.proxy import UpstreamClient


@dataclass(frozen=True)
class RoutePlan:
    route: Route
    rules: tuple[Rule, ...]
    args: tuple[RuleSpec, ...]
    prefix_keys: tuple[str, ...]   # "<prefix>:{<route>}:<rule>:" per rule
    readable: tuple[KeyForm, ...]  # per rule, how its identity is written (gateway/keys.py)
    needs_body: bool
    client: UpstreamClient | None  # None: the middleware, which forwards to the app it wraps
    # shards: N > 1 (gateway.keys): per shard, each rule's spec (its share where split) and key prefix;
    # args and prefix_keys are shard 0's
    shard_args: tuple[tuple[RuleSpec, ...], ...] = ()
    shard_prefix_keys: tuple[tuple[str, ...], ...] = ()
    # its identities are functions of the request's bytes alone (no JWT, no body): gateway/repeats.py
    repeatable: bool = False
    # counting by the answer (gateway/settlement.py): per shard, the specs of the settling script,
    # and the response fields that declare a cost (withheld from the client)
    shard_settle_args: tuple[tuple[RuleSpec, ...], ...] = ()
    withheld: frozenset[bytes] = frozenset()
    holds_slots: bool = False  # concurrency rules: a request holds its slots while in flight (gateway/leases.py)
    # token budgets: the answer's JSON paths their settlement reads (gateway/usage.py)
    usage_paths: tuple[tuple[str, ...], ...] = ()
    costs_fixed: bool = False  # no request declares its cost (a cost header, a token budget): the file's

    @property
    def settles(self) -> bool:
        return bool(self.shard_settle_args)

    @property
    def shards(self) -> int:
        return self.route.shards

    def shard_of(self, first_parts: Sequence[bytes] | None) -> int:
        """The shard of a request whose first rule has these identity parts (as read: a secret
        one counts as its fingerprint, so the admin port finds the shard from that alone)."""
        if self.route.shards == 1 or not first_parts:
            return 0 if self.route.shards == 1 else shard_of((), self.route.shards)
        return shard_of(canonical_parts(first_parts, self.readable[0]), self.route.shards)


def route_plan(route: Route, key_prefix: str, client: UpstreamClient | None) -> RoutePlan:
    shards = route.shards
    uses_shared = any(rule.shared for rule in route.limits)
    tags = (SHARED_TAG,) if uses_shared else shard_tags(route.name, shards)
    split = route.split
    shared: dict[tuple[RuleSpec, ...], tuple[RuleSpec, ...]] = {}  # N shards, at most rules + 1 kinds
    shard_args = []
    for shard in range(shards):
        specs = tuple(rule_spec(rule, shards, shard) if cut else rule_spec(rule)
                      for rule, cut in zip(route.limits, split, strict=True))
        shard_args.append(shared.setdefault(specs, specs))
    shard_prefix_keys = tuple(
        tuple(state_key(key_prefix, route.name, rule_segment(route.name, rule.name, rule.shared, uses_shared), "", tag)
              for rule in route.limits) for tag in tags
    )
    return RoutePlan(
        route=route,
        rules=route.limits,
        args=shard_args[0],
        prefix_keys=shard_prefix_keys[0],
        readable=tuple(key_form(rule) for rule in route.limits),
        needs_body=any(s.kind == "body" for rule in route.limits for s in rule.by) or any(
            rule.reserve_field for rule in route.limits),
        client=client,
        shard_args=tuple(shard_args),
        shard_prefix_keys=shard_prefix_keys,
        repeatable=not any(s.kind in ("body", "jwt") for rule in route.limits for s in rule.by) and not any(
            rule.reserve_field for rule in route.limits),
        shard_settle_args=tuple(tuple(spec.settling() for spec in specs) for specs in shard_args)
        if any(rule.settles for rule in route.limits) else (),
        withheld=frozenset(rule.cost_response_header.encode() for rule in route.limits if rule.cost_response_header),
        holds_slots=any(rule.algorithm == "concurrency" for rule in route.limits),
        usage_paths=tuple(dict.fromkeys(rule.settle_field for rule in route.limits if rule.settle_field)),
        costs_fixed=not any(rule.cost_header or rule.reserve_field for rule in route.limits),
    )
