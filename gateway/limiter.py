"""Limiter.decide(rules, keys, costs) -> Decision, in one script call. Knows nothing of HTTP."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

from gateway.breaker import Breaker, BreakerState
from gateway.config import ALGORITHMS, BUCKET_ALGORITHMS, Rule
from gateway.errors import RedisUnavailable
from gateway.redis_client import RedisReplyError
from gateway.scripts import Script

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


_CODES = {name: str(i + 1).encode() for i, name in enumerate(ALGORITHMS)}


def rule_args(rule: Rule) -> list[bytes]:
    """The four fixed script arguments of one rule (algorithm, p1, p2, shadow); cost comes per call."""
    if rule.algorithm in BUCKET_ALGORITHMS:
        p1, p2 = rule.burst, repr(1_000_000 / rule.rate)
    else:
        p1, p2 = rule.limit, str(round(rule.window * 1_000_000))
    return [_CODES[rule.algorithm], str(p1).encode(), p2.encode(), b"1" if rule.shadow else b"0"]


def _ms(us: int) -> int:
    return -(-us // 1000) if us >= 0 else -1


def parse_reply(reply: list[int], count: int) -> Decision:
    admitted = reply[0] == 1
    states = tuple(
        RuleState(Outcome(reply[4 + 3 * i]), reply[5 + 3 * i], _ms(reply[6 + 3 * i]))
        for i in range(count)
    )
    if admitted:
        return Decision(True, None, None, _ms(reply[3]), states)
    retry = reply[2]
    return Decision(False, reply[1] - 1, None if retry < 0 else _ms(retry), 0, states)


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
        self.script = Script("decide")

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    async def decide(
        self,
        rules: Sequence[Sequence[bytes]],
        keys: list[str],
        costs: Sequence[int],
        peek: bool = False,
    ) -> Decision:
        """rules: each rule's `rule_args()`; keys and costs: one per rule, in the same order."""
        args: list[bytes | str | int] = [len(keys), b"1" if peek else b"0"]
        for fixed, cost in zip(rules, costs, strict=True):
            args.extend((fixed[0], fixed[1], fixed[2], cost, fixed[3]))
        if not self.breaker.allow():
            raise RedisUnavailable("Redis circuit breaker is open")
        started = time.perf_counter()
        try:
            reply = await self.runner.run(self.script, keys, args)
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
        return parse_reply(reply, len(keys))
