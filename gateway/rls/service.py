"""`ShouldRateLimit`: Envoy's rate limit service on the gateway's engine.

A request names a domain and a list of descriptors. Each descriptor is looked up in its domain's
tree as envoyproxy/ratelimit does (`Domains.limit_of`): entry by entry, `key_value` before a
`value*` prefix before `key` alone; the rule of the node the LAST entry reaches counts it. Then, and
this is the difference that is the point, every counted descriptor of the request goes into ONE
script call, all or nothing: a request refused on one descriptor consumes nothing from the others.

    statuses          one per descriptor, in the request's order: OK or OVER_LIMIT, the limit,
                      what remains, how long until the window resets
    overall_code      OVER_LIMIT when any descriptor is over
    headers           `defaults.headers` (draft / legacy / both / none) as response_headers_to_add
    no such domain    OK, no limits (as envoyproxy/ratelimit)
    Redis unavailable UNAVAILABLE: Envoy's failure_mode_deny decides
    malformed         INVALID_ARGUMENT naming the problem; nothing is counted

The domain's rules belong to a route of its own (`rls.<domain>`), so keys, per-identity overrides,
refusals held in memory and metrics are those of any route.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from gateway import metrics
from gateway.config import MAX_RULES, Rule
from gateway.config.model import RlsDescriptor
from gateway.decision import decide
from gateway.errors import RedisUnavailable
from gateway.keys import shard_of
from gateway.limiter import RuleOutcome, RuleSpec
from gateway.overrides import RouteTable
from gateway.responses import ratelimit_headers, refusal
from gateway.rls import messages as pb
from gateway.rls.domains import CODE_SECONDS, Counted, Domain, domains_of
from gateway.runtime import Runtime

# gRPC status codes (grpc/status.h)
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED, UNAVAILABLE = 3, 8, 12, 14

MAX_DESCRIPTORS = 64        # per request; of their limits, at most MAX_RULES distinct ones (one script call)
MAX_ENTRIES = 16            # per descriptor: the depth a tree may have
MAX_HITS = 1_000_000_000    # a request's or descriptor's hits_addend, as a rule's cost
UNLIMITED_REMAINING = 2**32 - 1  # what envoyproxy/ratelimit reports for an unlimited descriptor
_UNIT_WORDS = {code: word for word, code in pb.UNIT_NAMES.items()} | {5: "month", 6: "year"}
_BODY_FIELDS = (b"content-type", b"content-length")  # a refusal's, of the body the RLS never sends


class GrpcError(Exception):
    """A call answered with a gRPC status other than OK, and this message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Descriptors:
    """One ShouldRateLimit call's descriptors, read and checked, before anything is counted.

    A domain with `shards: N` (Redis Cluster) puts the call in the shard its first counted
    descriptor's values choose: that descriptor's rule holds its whole limit there, every other
    rule of the call its share (keys.shard_of, shard_share), as a route's rules do.

    Redis keeps every script it loads, and a client chooses the numbers (a descriptor's own
    `limit`), the order and the combination of kinds of its calls: none of them may choose a
    script. A call counting one rule of the file, as the file has it, runs that rule's own script
    (one per rule, the fastest); any other goes to the one script for rules of any
    kinds, their kinds and numbers in ARGV (`any_kinds`)."""

    def __init__(self, call: Call, domain: Domain, overrides: RouteTable | None, key_prefix: str) -> None:
        self.counted: list[Counted] = []
        self.costs: list[int] = []
        self.where: list[int | None] = []  # per descriptor: its place in `counted`, None: not counted
        self.unlimited: list[bool] = []
        plan = domain.plan
        found: list[tuple[RlsDescriptor | None, tuple[tuple[str, str], ...], int, Any]] = []
        replaced: set[str] = set()
        for entries, cost, limit in call.descriptors:
            if cost is None:
                cost = call.hits
            if limit is not None:
                found.append((None, entries, cost, _dynamic_rule(limit)))
                continue
            d = domain.limit_of(entries)
            found.append((d, entries, cost, None))
            if d is not None and d.rule is not None:
                replaced.update(d.replaces)
        names = domain.domain.names
        counted = [dynamic is not None or (d is not None and d.rule is not None and names[d.rule] not in replaced)
                   for d, _, _, dynamic in found]
        shard, first = 0, None
        if plan.shards > 1:
            first = next((j for j, yes in enumerate(counted) if yes), None)
            if first is not None:
                shard = shard_of([value.encode() for _, value in found[first][1]], plan.shards)
        index: dict[str, int] = {}
        for j, (d, entries, cost, dynamic) in enumerate(found):
            self.unlimited.append(d is not None and d.unlimited)
            this = None
            if dynamic is not None:
                this = domain.dynamic(dynamic, entries, shard, key_prefix)
            elif counted[j]:
                assert d is not None
                assert d.rule is not None
                this = domain.counted(d.rule, [value.encode() for _, value in entries], shard,
                                      j == first or plan.shards == 1, overrides)
            if this is None:
                self.where.append(None)
                continue
            at = index.get(this.key)
            if at is None:  # one key twice in a call: one rule in the script, the costs summed
                at = index[this.key] = len(self.counted)
                self.counted.append(this)
                self.costs.append(0)
            self.costs[at] += cost
            self.where.append(at)
        if len(self.counted) > MAX_RULES:
            raise GrpcError(INVALID_ARGUMENT, f"the descriptors count {len(self.counted)} different limits; one call "
                                              f"decides at most {MAX_RULES}")

    @property
    def specs(self) -> list[RuleSpec]:
        return [c.spec for c in self.counted]

    def any_kinds(self, domain: Domain) -> tuple[str, ...] | None:
        """The calendars for the script of any kinds, or None: a script the file already has, the
        one rule's own, or the route's when the call counts all its rules as the file has them, in
        its order (Envoy's usual call: one descriptor per rule), which costs Redis 10-18% less."""
        counted = self.counted
        if len(counted) == 1 and counted[0].configured:
            return None
        rules = domain.plan.rules
        if (domain.plan.shards == 1 and len(counted) == len(rules)
                and all(c.configured and c.rule is rule for c, rule in zip(counted, rules, strict=True))):
            return None
        return domain.calendars


class Read(NamedTuple):
    """One descriptor of a call, checked."""

    entries: tuple[tuple[str, str], ...]
    cost: int | None                # its own hits_addend; None: the call's
    limit: tuple[int, int] | None   # its own limit: requests_per_unit, unit


class Call(NamedTuple):
    """A RateLimitRequest, checked as a message (what its domain counts is checked after: at most
    MAX_RULES distinct limits)."""

    domain: str
    hits: int
    descriptors: tuple[Read, ...]


_REMEMBERED_CALL = 1024  # bytes: a call of a few descriptors of usual values
_SEEN = 16 * 1024  # calls seen once, by their bytes' hash (plain ints: nothing for the collector to walk)
_seen: set[int] = set()


def read_call(body: bytes, identity_max: int) -> tuple[Call, bool]:
    """A RateLimitRequest's bytes, parsed and checked (raises GrpcError INVALID_ARGUMENT naming what
    is wrong), and whether it is remembered. A caller's next calls carry the same bytes (its user,
    its address), and reading them again costs more than the rest of the service's own part, so a
    call of a usual size is remembered from the second time it is seen. A call seen once is not: a
    stream of calls that never repeat (every address of a large fleet) costs what reading costs,
    where keeping each would churn the memory and the garbage collector with it. A GrpcError is never
    remembered."""
    if len(body) <= _REMEMBERED_CALL:
        mark = hash(body)
        if mark in _seen:
            return _remembered_call(body, identity_max), True
        call = _read_call(body, identity_max)
        if len(_seen) >= _SEEN:
            _seen.clear()
        _seen.add(mark)
        return call, False
    return _read_call(body, identity_max), False


@functools.lru_cache(maxsize=2048)  # about 1.3 KB a call, its bytes included
def _remembered_call(body: bytes, identity_max: int) -> Call:
    return _read_call(body, identity_max)


def _read_call(body: bytes, identity_max: int) -> Call:
    try:
        request = pb.RateLimitRequest.FromString(body)
    except DecodeError as exc:
        raise GrpcError(INVALID_ARGUMENT, f"the message is not a RateLimitRequest: {exc}") from None
    if not request.domain:
        raise GrpcError(INVALID_ARGUMENT, "domain must not be empty")
    if not request.descriptors:
        raise GrpcError(INVALID_ARGUMENT, "descriptors must not be empty")
    if len(request.descriptors) > MAX_DESCRIPTORS:
        raise GrpcError(INVALID_ARGUMENT, f"at most {MAX_DESCRIPTORS} descriptors in one request")
    hits = request.hits_addend or 1
    if hits > MAX_HITS:
        raise GrpcError(INVALID_ARGUMENT, f"hits_addend must be at most {MAX_HITS}")
    read = []
    for i, descriptor in enumerate(request.descriptors):
        entries = _entries(descriptor, i, identity_max)
        cost = limit = None
        if descriptor.HasField("hits_addend"):
            cost = descriptor.hits_addend.value
            if cost > MAX_HITS:
                raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}].hits_addend must be at most {MAX_HITS}")
        if descriptor.HasField("limit"):
            limit = descriptor.limit.requests_per_unit, descriptor.limit.unit
            if limit[1] not in CODE_SECONDS:
                raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}].limit.unit is not a known unit ({limit[1]})")
        read.append(Read(entries, cost, limit))
    return Call(request.domain, hits, tuple(read))


def _entries(descriptor: Any, i: int, identity_max: int) -> tuple[tuple[str, str], ...]:
    entries = tuple([(entry.key, entry.value) for entry in descriptor.entries])
    if not entries:
        raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}] has no entries")
    if len(entries) > MAX_ENTRIES:
        raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}] has more than {MAX_ENTRIES} entries")
    for j, (key, value) in enumerate(entries):
        if not key:
            raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}].entries[{j}] has an empty key")
        if len(key.encode()) > identity_max or len(value.encode()) > identity_max:
            raise GrpcError(INVALID_ARGUMENT, f"descriptors[{i}].entries[{j}] is longer than identity.max_length "
                                              f"({identity_max} bytes)")
    return entries


def _dynamic_rule(limit: tuple[int, int]) -> tuple[Rule, Any]:
    """A descriptor's own `limit` (envoyproxy/ratelimit: it replaces any configured one): a fixed
    window of its unit, and the RateLimit the answer reports."""
    requests_per_unit, unit = limit
    # the name (a metrics label) knows the unit only; the key knows the number too (Domain.dynamic)
    rule = Rule(name=f"descriptor_limit.{_UNIT_WORDS[unit]}", by=(), algorithm="fixed_window",
                limit=requests_per_unit, window=float(CODE_SECONDS[unit]))
    return rule, pb.RateLimitResponse.RateLimit(requests_per_unit=requests_per_unit, unit=unit)


class Counting(NamedTuple):
    """What a call counts, in a domain of one runtime: its Descriptors, what the limiter is asked,
    and its answer's statuses before the decision (a copy is filled in: 2 µs less than building them)."""

    descriptors: Descriptors
    rules: list[Rule]
    keys: list[str]
    costs: list[int | None]
    specs: list[RuleSpec]
    any_kinds: tuple[str, ...] | None
    answer: Any  # a RateLimitResponse: a status per descriptor, OK, each counted one's current_limit


def _statuses(call: Descriptors) -> Any:
    answer = pb.RateLimitResponse(overall_code=pb.OK)
    for at, unlimited in zip(call.where, call.unlimited, strict=True):
        status = answer.statuses.add(code=pb.OK)
        if at is not None:
            status.current_limit.CopyFrom(call.counted[at].limit)
        elif unlimited:
            status.limit_remaining = UNLIMITED_REMAINING
    return answer


MAX_COUNTINGS = 2048  # per runtime: calls remembered with what they count (about 3 KB each)


class Compiled(NamedTuple):
    """One runtime's domains, and what the remembered calls of its domains without overrides count:
    a call remembered by read_call is the same object again, and so is what it counts (its keys,
    rules and specs are functions of the call and the domain alone while no identity of the domain's
    route is overridden; one that is, is worked out at every call)."""

    runtime: Runtime
    domains: dict[str, Domain]
    countings: dict[int, tuple[Call, Counting]]  # id(call): the call is held, so its id is not reused


class RateLimitService:
    """The service behind the RLS port's gRPC server (gateway/rls/server.py)."""

    def __init__(self, current: Callable[[], Runtime | None]) -> None:
        self.current = current
        self.compiled: list[Compiled] = []  # the newest runtimes'

    def _compiled(self, runtime: Runtime) -> Compiled:
        """The domains of `runtime`'s config, compiled at its first call (two kept: a reload's old
        runtime still answers the calls it took)."""
        for compiled in self.compiled:
            if compiled.runtime is runtime:
                return compiled
        compiled = Compiled(runtime, domains_of(runtime.config.rls, runtime.plans), {})
        self.compiled = [compiled, *self.compiled[:1]]
        return compiled

    async def should_rate_limit(self, body: bytes) -> bytes:
        """A RateLimitRequest's bytes -> the RateLimitResponse's; raises GrpcError."""
        try:
            runtime = self.current()
            if runtime is None:
                raise GrpcError(UNAVAILABLE, "the gateway is starting")
            call, remembered = read_call(body, runtime.config.identity_max_bytes)
            compiled = self._compiled(runtime)
            domain = compiled.domains.get(call.domain)
            if domain is None:  # as envoyproxy/ratelimit: no config, no limit
                response = pb.RateLimitResponse(overall_code=pb.OK)
                for _ in call.descriptors:
                    response.statuses.add(code=pb.OK)
                return _done(response, "no_domain")
            runtime.enter()
            try:
                return await self._decide(runtime, domain, *self._counting(runtime, compiled, domain, call, remembered))
            finally:
                runtime.leave()
        except GrpcError as exc:
            if exc.status != UNAVAILABLE:
                _count("invalid")
            raise

    @staticmethod
    def _counting(runtime: Runtime, compiled: Compiled, domain: Domain, read: Call,
                  remembered: bool) -> tuple[Counting, bool]:
        """What `read` counts, and whether it is remembered (its answer then a template to copy)."""
        overrides = runtime.overrides.get(domain.plan.route.name)
        kept = remembered and overrides is None
        if kept:
            found = compiled.countings.get(id(read))
            if found is not None and found[0] is read:
                return found[1], True
        call = Descriptors(read, domain, overrides, runtime.redis.key_prefix)
        counting = Counting(call, [c.rule for c in call.counted], [c.key for c in call.counted], list(call.costs),
                            call.specs, call.any_kinds(domain) if call.counted else None, _statuses(call))
        if kept:
            if len(compiled.countings) >= MAX_COUNTINGS:
                compiled.countings.clear()
            compiled.countings[id(read)] = read, counting
        return counting, kept

    async def _decide(self, runtime: Runtime, domain: Domain, counting: Counting, shared: bool) -> bytes:
        call, rules, keys, costs, specs, any_kinds, answer = counting
        if shared:  # a remembered call's: a copy is filled in
            response = pb.RateLimitResponse()
            response.CopyFrom(answer)
        else:
            response = answer
        if not call.counted:
            return _done(response, "ok")
        route = domain.plan.route
        try:
            decision, from_memory = await decide(runtime, route.name, rules, keys, costs, specs, any_kinds=any_kinds)
        except RedisUnavailable:
            _count("unavailable")
            raise GrpcError(UNAVAILABLE, "rate limiting is unavailable (Redis); Envoy's failure_mode_deny "
                                         "decides") from None
        if not decision.admitted:
            response.overall_code = pb.OVER_LIMIT
        mode = route.headers
        if mode != "none":
            if decision.admitted:
                headers = ratelimit_headers(mode, rules, decision)
            else:
                # the refusal's head less the framing of a body Envoy never sends (Envoy writes its own)
                headers = [(n, v) for n, v in refusal(route, rules, decision)[1] if n not in _BODY_FIELDS]
            for name, value in headers:
                response.response_headers_to_add.add(key=name.decode(), value=value.decode())
        statuses = response.statuses
        for i, at in enumerate(call.where):
            if at is None or (from_memory and at != decision.refused_by):
                continue  # not counted; or a refusal held in memory, which knows the refusing rule's state only
            status = statuses[i]
            state = decision.rules[at]
            if state.outcome in (RuleOutcome.REFUSES, RuleOutcome.NEVER_FITS) and not decision.admitted:
                status.code = pb.OVER_LIMIT
            elif state.outcome is not RuleOutcome.SHADOW_REFUSES:
                # a refused call counted nothing: the limiter reports what was there before it
                status.limit_remaining = min(max(0, state.remaining), 2**32 - 1)
            if state.reset_ms > 0:
                duration = status.duration_until_reset
                duration.seconds, millis = divmod(state.reset_ms, 1000)
                duration.nanos = millis * 1_000_000
        return _done(response, "ok" if decision.admitted else "over_limit")


def _count(result: str) -> None:
    metrics.rls_calls(result).inc()  # counted locally, flushed every second: no file write per call


def _done(response: Any, result: str) -> bytes:
    _count(result)
    return bytes(response.SerializeToString())


def health(body: bytes, runtime: Runtime | None) -> bytes:
    """grpc.health.v1.Health/Check: SERVING for "" and the rate limit service while every breaker
    is closed, NOT_SERVING while one is open or probing (Redis unavailable); NOT_FOUND for another
    service."""
    try:
        request = pb.HealthCheckRequest.FromString(body)
    except DecodeError as exc:
        raise GrpcError(INVALID_ARGUMENT, f"the message is not a HealthCheckRequest: {exc}") from None
    if request.service not in ("", SERVICE):
        raise GrpcError(5, f"unknown service {request.service[:200]!r}")
    serving = runtime is not None and runtime.limiter.breaker_state.name == "CLOSED"
    return bytes(pb.HealthCheckResponse(status=pb.SERVING if serving else pb.NOT_SERVING).SerializeToString())


SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
SHOULD_RATE_LIMIT = f"/{SERVICE}/ShouldRateLimit"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
