"""Limiter.decide(rules, keys, costs) -> Decision, in one script call. Knows nothing of HTTP."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

from gateway.breaker import Breaker, BreakerState
from gateway.decision_script import DecisionScript, Layout, RuleSpec, decision_script, rule_spec
from gateway.errors import RedisUnavailable
from gateway.redis_client import RedisReplyError
from gateway.scripts import Script

__all__ = ["Decision", "Limiter", "Outcome", "RuleSpec", "RuleState", "rule_spec"]

log = logging.getLogger("gateway.limiter")


class Outcome(IntEnum):
    ADMITS = 0
    REFUSES = 1
    NEVER_FITS = 2
    SHADOW_REFUSES = 3


class RuleState(NamedTuple):
    outcome: Outcome
    remaining: int
    reset_ms: int  # -1: never resets


class Decision(NamedTuple):
    admitted: bool
    refused_by: int | None       # index of the rule that refused (the one with the longest wait)
    retry_after_ms: int | None   # None: this request can never be admitted as it is
    delay_ms: int                # leaky_bucket: hold the request this long before forwarding
    rules: tuple[RuleState, ...]


class ScriptRunner(Protocol):
    """Where the script runs: one Redis, a Cluster, a Sentinel-managed primary."""

    async def run(self, script: Script, keys: list[str], args: list[bytes | str | int]) -> Any: ...

    async def command(self, key: str | None, *args: bytes | str | int) -> Any: ...

    def reset_connections(self) -> None: ...

    def close(self) -> None: ...


_OUTCOMES = tuple(Outcome)
MAX_SCRIPTS = 1024  # scripts kept: one per route and one per rule (peek); a config has fewer


def parse_reply(reply: list[int], layout: Layout, costs: Sequence[int | None]) -> Decision:
    """Unpack the reply of a script from gateway.decision_script (format: lua/decide.lua), leaving
    out the rules that sat out (cost None): indices count the rules that took part."""
    states = []
    for (at, radix), cost in zip(layout.slots, costs, strict=True):
        if cost is None:
            continue
        if radix:
            value = reply[at]
            remaining, reset = divmod(value >> 2, radix)
        else:
            remaining, value = reply[at], reply[at + 1]
            reset = value >> 2
        states.append(RuleState(_OUTCOMES[value & 3], remaining, reset - 1))
    head = reply[0]
    if head & 1:
        return Decision(True, None, None, head >> 1, tuple(states))
    retry = (head >> 9) - 1
    by = ((head >> 1) & 255) - 1
    by -= sum(1 for cost in costs[:by] if cost is None)
    return Decision(False, by, None if retry < 0 else retry, 0, tuple(states))


class Limiter:
    def __init__(
        self,
        runner: ScriptRunner,
        breaker: Breaker | None = None,
        observe: Callable[[float, bool], None] | None = None,
        on_breaker: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self.runner = runner
        self.breaker = breaker or Breaker()
        self.observe = observe
        self.on_breaker = on_breaker
        self.scripts: dict[tuple[tuple[RuleSpec, ...], bool], DecisionScript] = {}

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    async def ping(self) -> None:
        """Does Redis answer? Raises RedisUnavailable if not (bounded by redis.timeout). The
        breaker is neither consulted nor changed: a health check must not decide for requests."""
        reply = await self.runner.command(None, "PING")
        if isinstance(reply, RedisReplyError):
            raise RedisUnavailable(f"Redis answered PING with an error: {reply}")

    async def reset(self, key: str) -> bool:
        """Delete one rule's state for one identity (`key` from gateway.keys); True if it existed."""
        reply = await self.runner.command(key, "DEL", key)
        if isinstance(reply, RedisReplyError):
            raise RedisUnavailable(f"Redis refused the reset: {reply}")
        return bool(reply)

    async def decide(
        self,
        rules: Sequence[RuleSpec],
        keys: list[str],
        costs: Sequence[int | None],
        peek: bool = False,
    ) -> Decision:
        """rules: each rule's `rule_spec()`, a route's all; keys and costs: one per rule, in order.

        A cost of None: the request has no identity for that rule (its key is any key with the
        route's hash tag), which sits out and is left out of the Decision. So one script serves a
        route. peek: report the rules' state and write nothing (costs should be 0)."""
        combination = (tuple(rules), peek)
        found = self.scripts.get(combination)
        if found is None:
            if len(self.scripts) >= MAX_SCRIPTS:
                self.scripts.clear()
            found = self.scripts[combination] = decision_script(*combination)
        if len(keys) != len(rules) or len(costs) != len(rules):
            raise ValueError("one key and one cost per rule")
        if not self.breaker.allow():
            raise RedisUnavailable("Redis circuit breaker is open")
        started = time.perf_counter()
        try:
            reply = await self.runner.run(found.script, keys, [b"" if c is None else c for c in costs])
            if isinstance(reply, RedisReplyError):
                raise RedisUnavailable(f"Redis refused the decision: {reply}")
        except RedisUnavailable as exc:
            if self.observe:
                self.observe(time.perf_counter() - started, False)
            if self.breaker.record_failure():
                log.warning("Redis unavailable (%s): breaker open for %.1fs; routes follow their "
                            "failure_mode until it answers again", exc, self.breaker.open_for)
                self.runner.reset_connections()
                if self.on_breaker:
                    self.on_breaker(BreakerState.OPEN)
            raise
        if self.breaker.state is not BreakerState.CLOSED:
            log.warning("Redis answers again: breaker closed, limits apply")
            self.breaker.record_success()
            if self.on_breaker:
                self.on_breaker(BreakerState.CLOSED)
        else:
            self.breaker.record_success()
        if self.observe:
            self.observe(time.perf_counter() - started, True)
        assert isinstance(reply, list)
        return parse_reply(reply, found.layout, costs)
