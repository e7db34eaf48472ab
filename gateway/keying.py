"""How a rule is keyed for one identity, whichever door asks (the pipeline, the RLS service, the
usage route, the admin port): the identity's parts -> its token -> the rule's key in a shard -> the
override that identity has, if any. Written once, so that a key the admin port resets, the usage
route reads and the pipeline counts is the same key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.config import Rule
from gateway.keys import form_token
from gateway.limiter import RuleSpec
from gateway.overrides import Entry, RouteTable, overridden
from gateway.plan import RoutePlan


class Keyed(NamedTuple):
    """One rule of a route for one identity in one shard."""

    key: str
    rule: Rule                # as overridden for this identity
    spec: RuleSpec            # its spec in the shard, overridden or the route's
    override: Entry | None    # the identity's override; None: the file's numbers

    @property
    def unlimited(self) -> bool:
        """An override makes the rule unlimited for this identity: it sits out (rule and spec stay
        the file's, for whoever reads the key's state)."""
        return self.override is not None and self.override.rule is None


def token_of(plan: RoutePlan, index: int, parts: Sequence[bytes]) -> str:
    """The identity token of rule `index` for these parts as read from a request (the last segment of
    its key: readable, or a digest; a secret part counted by its fingerprint)."""
    return form_token(parts, plan.readable[index])


def keyed(plan: RoutePlan, index: int, token: str, shard: int, overrides: RouteTable | None) -> Keyed:
    """Rule `index` for the identity `token` in `shard`, as overridden for that identity."""
    key = plan.shard_prefix_keys[shard][index] + token
    found = overridden(overrides, index, token) if overrides else None
    if found is None or found.rule is None:
        return Keyed(key, plan.rules[index], plan.shard_args[shard][index], found)
    return Keyed(key, found.rule, found.specs[shard], found)
