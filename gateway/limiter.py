"""Limiter.decide(rules, keys, costs) -> Decision, in one script call. Knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

from gateway.breaker import Breaker, BreakerState
from gateway.decision_script import (
    DecisionScript,
    Kind,
    Layout,
    RuleSpec,
    decision_script,
    generic_kinds,
    generic_layout,
    generic_params,
    generic_script,
    overridden_script,
    override_shape,
    rule_spec,
    shape_script,
)
from gateway.errors import BreakerOpen, RedisUnavailable
from gateway.scripts import Script

__all__ = ["Decision", "Limiter", "RuleOutcome", "RuleSpec", "RuleState", "rule_spec"]

log = logging.getLogger("gateway.limiter")


class RuleOutcome(IntEnum):
    ADMITS = 0
    REFUSES = 1
    NEVER_FITS = 2
    SHADOW_REFUSES = 3


class RuleState(NamedTuple):
    outcome: RuleOutcome
    remaining: int
    reset_ms: int  # -1: never resets


class Decision(NamedTuple):
    admitted: bool
    refused_by: int | None       # index of the rule that refused (the one with the longest wait)
    retry_after_ms: int | None   # None: this request can never be admitted as it is
    delay_ms: int                # leaky_bucket: hold the request this long before forwarding
    rules: tuple[RuleState, ...]


class ScriptRunner(Protocol):
    """Where the script runs: one Redis, a Cluster, a Sentinel-managed primary (gateway.redis).
    Every failure is raised as a gateway.errors.RedisUnavailable subclass, within the timeout."""

    def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Awaitable[Any]:
        """The script's reply (a list of integers)."""
        ...

    def failure_domain(self, key: str) -> int | None:
        """What fails together with `key`'s server: None where one server holds every key, the
        key's slot in a Cluster (so one dead primary opens only its slots' breakers)."""
        ...

    async def prepare(self, key: str, scripts: Sequence[Script], timeout: float) -> None:
        """The breaker's probe for `key`'s failure domain, off every request's path: connect, load
        `scripts` and see Redis answer within `timeout`, leaving the connection ready for the next
        call. Raises a gateway.errors.RedisUnavailable subclass."""
        ...

    async def ping(self) -> None: ...

    async def delete(self, key: str) -> bool: ...

    async def close(self) -> None: ...


_OUTCOMES = tuple(RuleOutcome)
_new = tuple.__new__  # a NamedTuple from its fields' tuple, without the generated __new__'s frame (half the cost)
_SEVERITY = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
LEASES = Script("leases")
PROTECT = Script("protect")
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
        states.append(_new(RuleState, (_OUTCOMES[value & 3], remaining, reset - 1)))
    head = reply[0]
    if head & 1:
        return _new(Decision, (True, None, None, head >> 1, tuple(states)))
    retry = (head >> 9) - 1
    by = ((head >> 1) & 255) - 1
    by -= sum(1 for cost in costs[:by] if cost is None)
    # the script reports a rule that would admit as if charged; a refused request was charged nothing
    taking_part = [cost for cost in costs if cost is not None]
    states = [state._replace(remaining=state.remaining + cost) if state.outcome is RuleOutcome.ADMITS else state
              for state, cost in zip(states, taking_part, strict=True)]
    return Decision(False, by, None if retry < 0 else retry, 0, tuple(states))


def _where(domain: int | None) -> str:
    return "" if domain is None else f" for cluster slot {domain}"


class Limiter:
    def __init__(
        self,
        runner: ScriptRunner,
        breaker: Breaker | None = None,
        observe: Callable[[float, bool], None] | None = None,
        on_breaker: Callable[[BreakerState], None] | None = None,
        on_open_time: Callable[[float], None] | None = None,
        probe_timeout: float = 1.0,
    ) -> None:
        self.runner = runner
        self.breaker = breaker or Breaker()  # the one of the default domain, and the others' model
        self.breakers: dict[int, Breaker] = {}  # per failure domain (a Cluster slot)
        self.observe = observe
        self.on_breaker = on_breaker
        self.on_open_time = on_open_time  # seconds a breaker spent open, reported as they pass
        self.probe_timeout = probe_timeout  # the probe's own budget: connect, load scripts, answer
        self._probes: dict[int | None, asyncio.Task[None]] = {}  # per open breaker's domain
        self.scripts: dict[tuple[tuple[RuleSpec, ...], bool], DecisionScript] = {}
        # routes with overridden rules (gateway/overrides.py): one script per shape, numbers in ARGV
        self.shapes: dict[tuple[tuple[RuleSpec, ...], frozenset[int], bool], DecisionScript] = {}
        # rules of any kinds (the RLS port's calls): one script per set of calendars, of the config
        self.generic: dict[tuple[str, ...], tuple[DecisionScript, dict[Kind, int]]] = {}
        # ... and a call's ARGV for its rules, packed once per shape (bounded: the numbers are the callers')
        self.generic_calls: dict[tuple[tuple[str, ...], tuple[RuleSpec, ...]], DecisionScript] = {}

    @property
    def breaker_state(self) -> BreakerState:
        """The worst of the breakers: OPEN if any is open (some keys follow the failure policy)."""
        if not self.breakers:
            return self.breaker.state
        return max([self.breaker.state, *(b.state for b in self.breakers.values())], key=_SEVERITY.__getitem__)

    def _breaker_for(self, domain: int | None) -> Breaker:
        if domain is None:
            return self.breaker
        found = self.breakers.get(domain)
        if found is None:
            found = self.breakers[domain] = Breaker(self.breaker.failures_to_open, self.breaker.open_for)
        return found

    async def decide(
        self,
        rules: Sequence[RuleSpec],
        keys: list[str],
        costs: Sequence[int | None],
        peek: bool = False,
        lease: bytes = b"",
        any_kinds: tuple[str, ...] | None = None,
    ) -> Decision:
        """rules: each rule's `rule_spec()`, a route's all; keys and costs: one per rule, in order.

        A cost of None: the request has no identity for that rule (its key is any key with the
        route's hash tag), which sits out and is left out of the Decision. So one script serves a
        route. peek: report the rules' state and write nothing (costs should be 0). lease: the
        request's lease token, for a route with concurrency rules. any_kinds: the rules may be of any
        combination of kinds, fixed by none of the config's routes (the RLS port's calls): they run
        in the one script that takes any (decision_script.write_generic), which knows these calendars.
        So the scripts a client's choices load into Redis stay few, whatever it sends."""
        if any_kinds is not None:
            found = self._generic(rules, any_kinds)
        else:
            combination = (tuple(rules), peek)
            found = self.scripts.get(combination) or self._script(*combination)
        if len(keys) != len(rules) or len(costs) != len(rules):
            raise ValueError("one key and one cost per rule")
        domain = self.runner.failure_domain(keys[0]) if keys else None
        breaker = self.breaker if domain is None else self._breaker_for(domain)
        if breaker.state is not BreakerState.CLOSED:  # breaker.allow(), inlined on the decision's path
            raise BreakerOpen("Redis circuit breaker is open")
        started = time.perf_counter()
        try:
            args: list[bytes | int] = [b"" if c is None else c for c in costs]
            if lease:
                args.append(lease)
            if found.params:  # last: lua/decide.lua reads them at ARGV[#ARGV]
                args.extend(found.params)
            reply = await self.runner.run(found.script, keys, args)
        except RedisUnavailable as exc:
            if self.observe:
                self.observe(time.perf_counter() - started, False)
            if breaker.record_failure(exc):
                log.warning("Redis unavailable%s (%s): breaker open; routes follow their failure_mode "
                            "until a probe sees it answer (every %.1fs)", _where(domain), exc, breaker.open_for)
                self._opened(breaker, domain, keys[0])
            raise
        breaker.record_success()
        if self.observe:
            self.observe(time.perf_counter() - started, True)
        assert isinstance(reply, list)
        return parse_reply(reply, found.layout, costs)

    def _opened(self, breaker: Breaker, domain: int | None, key: str) -> None:
        if self.on_breaker:
            self.on_breaker(self.breaker_state)
        probe = self._probes.get(domain)
        if probe is None or probe.done():
            self._probes[domain] = asyncio.get_running_loop().create_task(self._probe(breaker, domain, key))

    async def _probe(self, breaker: Breaker, domain: int | None, key: str) -> None:
        """Ask Redis every `open_for` seconds, with a budget of its own and no request waiting on
        it, until it answers; then close the breaker. Connecting and loading the scripts happen
        here, so the first requests after it cost one round trip, as before the failure."""
        attempts = 0
        while True:
            await asyncio.sleep(breaker.open_for)
            breaker.probing()
            self._report(breaker)
            attempts += 1
            try:
                await self.runner.prepare(key, self._known_scripts(), self.probe_timeout)
            except RedisUnavailable as exc:
                breaker.probe_failed()
                self._report(breaker)
                log.info("Redis still unavailable%s (%s): probe %d failed", _where(domain), exc, attempts)
                continue
            spent = breaker.close()
            self._report(breaker)
            log.warning("Redis answers again%s: breaker closed after %.1fs, limits apply",
                        _where(domain), spent)
            return

    def _report(self, breaker: Breaker) -> None:
        if self.on_open_time:
            self.on_open_time(breaker.open_time())
        if self.on_breaker:
            self.on_breaker(self.breaker_state)

    def _known_scripts(self) -> list[Script]:
        """Every script this limiter has run, for the probe to load before requests need them."""
        scripts = {found.script.sha: found.script for found in self.scripts.values()}
        scripts.update((found.script.sha, found.script) for found in self.shapes.values())
        scripts.update((found.script.sha, found.script) for found, _ in self.generic.values())
        scripts[LEASES.sha] = LEASES
        scripts[PROTECT.sha] = PROTECT
        return list(scripts.values())

    def _script(self, specs: tuple[RuleSpec, ...], peek: bool) -> DecisionScript:
        if all(spec.base is None for spec in specs):
            if len(self.scripts) >= MAX_SCRIPTS:
                self.scripts.clear()
            script = self.scripts[(specs, peek)] = decision_script(specs, peek)
            return script
        # with overrides: the numbers vary by identity, the script by shape only; neither is kept
        # beside the file's scripts, so many distinct overrides never push those out
        shape, overridden = override_shape(specs)
        found = self.shapes.get((shape, overridden, peek))
        if found is None:
            if len(self.shapes) >= MAX_SCRIPTS:
                self.shapes.clear()
            found = self.shapes[(shape, overridden, peek)] = shape_script(shape, overridden, peek)
        return overridden_script(specs, found)

    def _generic(self, specs: Sequence[RuleSpec], calendars: tuple[str, ...]) -> DecisionScript:
        known = self.generic.get(calendars)
        if known is None:
            known = self.generic[calendars] = (generic_script(calendars), generic_kinds(calendars))
        script, kinds = known
        key = (calendars, tuple(specs))
        found = self.generic_calls.get(key)
        if found is None:  # a call's shape (its rules' kinds and numbers): the same for most calls
            if len(self.generic_calls) >= MAX_SCRIPTS:
                self.generic_calls.clear()
            found = self.generic_calls[key] = DecisionScript(script.script, generic_layout(len(specs)),
                                                             generic_params(specs, kinds))
        return found

    async def run_script(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        """Run one of the overrides' store scripts (gateway/overrides.py); Redis errors as
        RedisUnavailable subclasses. Not a decision: no breaker, no latency observed."""
        return await self.runner.run(script, keys, args)

    # --- the admin port's view of Redis: it never sees the runner or a reply ------------------

    async def leases(self, release: bool, keys: Sequence[str], args: Sequence[bytes | int]) -> int:
        """Give back (release) or renew concurrency leases: lua/leases.lua, keys of one hash tag.
        Raises a RedisUnavailable subclass; not asked while the keys' breaker is open."""
        breaker = self._breaker_for(self.runner.failure_domain(keys[0]))
        if not breaker.allow():
            raise BreakerOpen("Redis circuit breaker is open")
        reply = await self.runner.run(LEASES, keys, [b"release" if release else b"renew", *args])
        return int(reply)

    async def protect(self, keys: Sequence[str], args: Sequence[bytes | int]) -> list[int]:
        """A fleet-wide protect:'s slot taken, or its limit stepped: lua/protect.lua. Behind the keys'
        breaker, whose count it adds to; raises a RedisUnavailable subclass."""
        domain = self.runner.failure_domain(keys[0])
        breaker = self._breaker_for(domain)
        if not breaker.allow():
            raise BreakerOpen("Redis circuit breaker is open")
        try:
            reply = await self.runner.run(PROTECT, keys, args)
        except RedisUnavailable as exc:
            if breaker.record_failure(exc):
                log.warning("Redis unavailable%s (%s): breaker open; routes follow their failure_mode "
                            "until a probe sees it answer (every %.1fs)", _where(domain), exc, breaker.open_for)
                self._opened(breaker, domain, keys[0])
            raise
        breaker.record_success()
        assert isinstance(reply, list)
        return [int(value) for value in reply]

    async def ping(self) -> None:
        """Return when Redis answers PING; raise a RedisUnavailable subclass otherwise."""
        await self.runner.ping()

    async def reset(self, key: str) -> bool:
        """Delete one state key (in Cluster mode on the node owning it); True if it existed."""
        return await self.runner.delete(key)

    async def close(self) -> None:
        for probe in self._probes.values():
            probe.cancel()
        self._probes.clear()
        await self.runner.close()
