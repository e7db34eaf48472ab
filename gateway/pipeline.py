"""One request's way through the gateway: read -> match -> identity -> memory -> limiter.

`decide()` takes one ASGI request and returns what to do with it: `Admit` (forward it, with these
rate-limit headers, after this delay) or `Answer` (send this instead). Its three callers share it:

- the proxy endpoint (gateway/endpoint.py) forwards an Admit and sends an Answer;
- the in-process middleware (gateway/middleware.py) calls the wrapped app for an Admit, and for a
  request that matched no route;
- the server protocol, before it enters the application, asks `decide_now()`: the synchronous first
  half of the same way (read, match, identity, memory), which answers only a refusal held in memory
  (gateway/refusals.py), so a flood costs no task and no ASGI message.

Nothing here sends, renders bytes or knows which server runs it; outcomes are `RequestOutcome`s,
which metrics and the access log read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from functools import partial
from typing import NamedTuple

from starlette.types import Receive, Scope

from gateway.admitted import Admitted
from gateway.config import Route, Rule
from gateway.decision import count_held
from gateway.decision import decide as decide_rules
from gateway.errors import BadRequest, IdentityMissing, RedisUnavailable
from gateway.http.request import Original, Request, read_request
from gateway.identity import RequestView, rule_identity
from gateway.kept import kept
from gateway.keying import keyed, token_of
from gateway.keys import shown
from gateway.known_identities import Identified, KnownIdentities
from gateway.leases import Lease, new_token
from gateway.limiter import Decision, RuleSpec
from gateway.outcome import Admit, Answer, DecidedBy, RequestBounds, RequestOutcome
from gateway.overrides import RouteTable
from gateway.plan import RoutePlan
from gateway.protect import RETRY_AFTER, Guard, shed_answer_fields
from gateway.repeats import Seen, request_key
from gateway.request_id import usable_request_id
from gateway.responses import Headers, problem, ratelimit_headers, refusal
from gateway.runtime import Runtime
from gateway.settlement import Settlement
from gateway.usage import reserve

MAX_COST_HEADER = 1_000_000_000
SETTLE_MARGIN = 0.01  # seconds; with redis.timeout: how long before its window ends a refund is still sent


EARLY_WORK = "gateway.early"  # a scope's key: what `decide_now` read of a request it did not answer


class Matched(NamedTuple):
    request: Request
    plan: RoutePlan
    view: RequestView


async def decide(runtime: Runtime, scope: Scope, receive: Receive, limits: RequestBounds,
                 guarded: bool = False, original: Original | None = None) -> Admit | Answer:
    """The whole way for one request: at most one limiter call (one Redis script call). `guarded`
    (the proxy port): a protected upstream's slot is taken before that call, and given back if the
    rules refuse; a request refused for want of one (503) is never counted by its rules. `original`
    (the check port): the request decided is the one the scope asks about (gateway/check.py)."""
    early = scope.pop(EARLY_WORK, None)
    if early is not None and early[0] is runtime:  # `decide_now` matched and identified it a moment ago
        _, step, identified = early
        result = await _guarded(runtime, step.plan, step.request, step.view, identified, step.request.has_body,
                                guarded)
    else:
        matched = _match(runtime, scope, limits, original)
        if isinstance(matched, Answer):
            return matched
        step = matched
        if step.plan.needs_body:
            result = await _decide_with_body(runtime, step, receive, limits, guarded)
        else:
            found = _decide_identified(runtime, step, step.request.has_body, guarded)
            result = found if isinstance(found, Answer) else await found
    result.consumer = step.view.consumer or ""
    return result


async def _decide_with_body(runtime: Runtime, step: Matched, receive: Receive, limits: RequestBounds,
                            guarded: bool) -> Admit | Answer:
    """A route whose identities or costs read the body: its first bytes are read before them."""
    request, _, view = step
    route = step.plan.route
    more_body = request.has_body
    if more_body:
        try:
            view.body_prefix, more_body = await _read_prefix(receive, runtime.config.body_digest_max_bytes,
                                                             limits.body_timeout)
        except TimeoutError:
            return _answer(problem(408, "the request body stopped arriving", route=route.name),
                           RequestOutcome.BAD_REQUEST, request, route=route.name, close=True)
        if view.body_prefix is None:
            return _answer((499, [], b""), RequestOutcome.CLIENT_GONE, request, route=route.name)
        view.body_more = more_body
    else:
        view.body_prefix = b""
    found = _decide_identified(runtime, step, more_body, guarded)
    return found if isinstance(found, Answer) else await found


def _decide_identified(runtime: Runtime, step: Matched, more_body: bool,
                       guarded: bool) -> Answer | Awaitable[Admit | Answer]:
    """The request's identities, then its decision to await; an Answer (400) when they cannot be read."""
    request, plan, view = step
    route = plan.route
    try:
        identified = identify(plan, view, runtime.overrides.get(route.name), runtime.known)
    except IdentityMissing as exc:
        return _answer(problem(400, str(exc), route=route.name, rule=exc.rule), RequestOutcome.BAD_REQUEST,
                       request, route=route.name, rule=exc.rule)
    except BadRequest as exc:
        return _answer(problem(exc.status, str(exc), route=route.name), RequestOutcome.BAD_REQUEST, request,
                       route=route.name)
    return _guarded(runtime, plan, request, view, identified, more_body, guarded)


def _guarded(runtime: Runtime, plan: RoutePlan, request: Request, view: RequestView, identified: Identified,
             more_body: bool, guarded: bool) -> Awaitable[Admit | Answer]:
    guard = runtime.guards.get(plan.route.name) if guarded and not request.upgrade else None
    if guard is None:
        return _limited(runtime, plan, request, view, identified, more_body)
    return _in_a_place(guard, runtime, plan, request, view, identified, more_body)


async def _in_a_place(guard: Guard, runtime: Runtime, plan: RoutePlan, request: Request, view: RequestView,
                      identified: Identified, more_body: bool) -> Admit | Answer:
    """A place in the protected upstream's limit, taken before the rules' call and given back if they
    refuse; none free for the request's priority: a 503, and the rules are never asked."""
    route = plan.route
    try:
        priority = guard.priority(view)
    except BadRequest as exc:  # a header a priority matches on came twice
        return _answer(problem(exc.status, str(exc), route=route.name), RequestOutcome.BAD_REQUEST, request,
                       route=route.name)
    try:
        slot = await guard.take(priority, fail_open=route.failure_mode == "open")
    except RedisUnavailable:  # fleet-wide, failure_mode closed
        return _failed_closed(request, route)
    if slot is None:
        detail, extra = shed_answer_fields(guard, priority, route.name)
        status, headers, body = problem(503, detail, **extra)
        headers.append((b"retry-after", b"%d" % RETRY_AFTER))
        return _answer((status, headers, body), RequestOutcome.SHED, request, route=route.name)
    try:
        result = await _limited(runtime, plan, request, view, identified, more_body)
    except BaseException:
        slot.release()
        raise
    if isinstance(result, Answer):
        slot.release()  # refused by its rules: it holds no place
    else:
        result.slot = slot
    return result


async def _limited(runtime: Runtime, plan: RoutePlan, request: Request, view: RequestView, identified: Identified,
                   more_body: bool) -> Admit | Answer:
    """The request's rules, in one limiter call."""
    route = plan.route
    rules, keys, costs, args, _, _ = identified
    if not rules:
        return Admit(request, plan, RequestOutcome.ADMITTED, [], 0, view.body_prefix, more_body)
    token = new_token() if plan.holds_slots else b""
    call = decide_rules(runtime, route.name, rules, keys, costs, args, token)
    try:
        if token or plan.settles:  # what it takes is given back if its client leaves meanwhile
            decision, from_memory = await kept(call, partial(
                _abandoned, runtime, plan, request, view, identified, more_body, token))
        else:
            decision, from_memory = await call
    except RedisUnavailable:
        if route.failure_mode == "closed":
            return _failed_closed(request, route)
        return Admit(request, plan, RequestOutcome.FAILED_OPEN, [], 0, view.body_prefix, more_body)
    return _decided(runtime, plan, request, view, identified, more_body, token, decision, from_memory)


def _abandoned(runtime: Runtime, plan: RoutePlan, request: Request, view: RequestView, identified: Identified,
               more_body: bool, token: bytes, call: asyncio.Future[tuple[Decision, bool]]) -> None:
    """An admission whose client left before it came: ended unanswered (499) at once, as the proxy ends
    one whose client leaves before its answer: its slots back, `refund_on: [499]` refunded."""
    if call.cancelled() or call.exception() is not None:
        return  # Redis unavailable: whatever it took, the lease runs out
    result = _decided(runtime, plan, request, view, identified, more_body, token, *call.result())
    if isinstance(result, Admit):
        Admitted(runtime, result).end()


def _decided(runtime: Runtime, plan: RoutePlan, request: Request, view: RequestView, identified: Identified,
             more_body: bool, token: bytes, decision: Decision, from_memory: bool) -> Admit | Answer:
    route = plan.route
    rules, keys, costs, args, shard, parts = identified
    if from_memory:
        return _refused(plan, rules, keys, parts, decision, DecidedBy.MEMORY, request.request_id)
    if not decision.admitted:
        return _refused(plan, rules, keys, parts, decision, DecidedBy.REDIS, request.request_id)
    headers = ratelimit_headers(route.headers, rules, decision)
    settlement = None
    if plan.settles:
        settlement = Settlement(plan, shard, keys, costs, decision, runtime.redis.timeout + SETTLE_MARGIN)
        if args is not plan.shard_args[shard]:  # overridden for this identity (gateway/overrides.py)
            settlement.settle_args = tuple(spec.settling() for spec in args)
    lease = _lease(plan, keys, costs, args, token) if token else None
    return Admit(request, plan, RequestOutcome.ADMITTED, headers, decision.delay_ms, view.body_prefix, more_body,
                 DecidedBy.REDIS, settlement, lease)


def _failed_closed(request: Request, route: Route) -> Answer:
    status, headers, body = problem(503, "rate limiting is unavailable; try again shortly", route=route.name)
    headers.append((b"retry-after", b"1"))
    return _answer((status, headers, body), RequestOutcome.FAILED_CLOSED, request, route=route.name)


def _lease(plan: RoutePlan, keys: list[str], costs: list[int | None], args: tuple[RuleSpec, ...],
           token: bytes) -> Lease | None:
    """The slots an admitted request took in its route's concurrency rules."""
    held = [i for i, (rule, cost) in enumerate(zip(plan.rules, costs, strict=True))
            if rule.algorithm == "concurrency" and cost]
    if not held:
        return None
    return Lease(token, plan.route.name, [plan.rules[i].name for i in held], [keys[i] for i in held],
                 [costs[i] or 0 for i in held], [args[i].p2 for i in held])


def decide_now(runtime: Runtime, scope: Scope, limits: RequestBounds) -> Answer | None:
    """The refusal held in memory for this request, without waiting for anything; None: `decide()`
    must take it the whole way. A request seen before byte for byte is not read again
    (gateway/repeats.py)."""
    if not runtime.refusals:
        return None  # nothing held: the common case
    key = request_key(scope)
    seen = runtime.repeats.get(key)
    if seen is not None:
        plan = runtime.plans[seen.route.name]
        decision = _held_decision(runtime, plan, seen.rules, seen.keys, seen.costs)
        if decision is None:
            return None  # no longer held: the whole way (the app reads the request itself)
        rendered = seen.rendered
        if rendered is None or rendered[0] != decision:  # the same decision is the same answer
            answer = _refused(plan, seen.rules, seen.keys, seen.parts, decision, DecidedBy.MEMORY, seen.request_id)
            answer.consumer = rendered[1].consumer if rendered is not None else ""
            rendered = seen.rendered = decision, answer
        return rendered[1]
    step = _match(runtime, scope, limits)
    if isinstance(step, Answer):
        return None  # the whole way answers it, counted there
    request, plan, view = step
    if plan.needs_body or not runtime.refusals.enabled or not plan.rules:
        return None
    try:
        identified = identify(plan, view, runtime.overrides.get(plan.route.name), runtime.known)
    except (IdentityMissing, BadRequest):
        return None
    rules, keys, costs, _, _, parts = identified
    decision = _held_decision(runtime, plan, rules, keys, costs)
    if decision is None:
        scope[EARLY_WORK] = runtime, step, identified  # not thrown away: `decide()` goes on from here
        return None
    answer = _refused(plan, rules, keys, parts, decision, DecidedBy.MEMORY, request.request_id)
    answer.consumer = view.consumer or ""
    if plan.repeatable:
        seen = Seen(plan.route, rules, keys, costs, answer.request_id, parts)
        seen.rendered = decision, answer
        runtime.repeats.put(key, seen)
    return answer


def _match(runtime: Runtime, scope: Scope, limits: RequestBounds, original: Original | None = None) -> Matched | Answer:
    try:
        request = read_request(scope, limits.max_head_bytes, original)
    except BadRequest as exc:
        return _answer(problem(exc.status, str(exc)), RequestOutcome.BAD_REQUEST, None, close=True)
    view = RequestView(request, {}, runtime.config, runtime.jwt)
    if runtime.config.keys is not None:  # API keys: the caller's plan, read from memory
        refused = _caller_plan(runtime, view, request)
        if refused is not None:
            return refused
    router = runtime.router
    try:  # a route's `match:` may read a header, claim or address that came twice: a 400, as an identity
        found = router.match(request.method, request.hostname, request.path,
                             view.meets if router.conditional else None, request.override)
    except BadRequest as exc:
        return _answer(problem(exc.status, str(exc)), RequestOutcome.BAD_REQUEST, request)
    if found is None:
        if request.override is not None and (refused := _literal_method(runtime, view, request)) is not None:
            return refused
        allowed = runtime.router.allowed_methods(request.hostname, request.path)
        if allowed:  # a route owns this path under other methods: a catch-all may not take it
            methods = ", ".join(sorted(allowed))
            status, headers, body = problem(
                405, f"{request.override or request.method} is not allowed on {request.path[:200]}; use {methods}")
            headers.append((b"allow", methods.encode()))
            return _answer((status, headers, body), RequestOutcome.METHOD_NOT_ALLOWED, request)
        return _answer(problem(404, f"no route matches {request.method} {request.path[:200]}"),
                       RequestOutcome.NO_ROUTE, request)
    route, view.params = found
    if request.override is not None:
        if route.method_override == "ignore":
            view.method = request.counted_method(honour_override=False)
        elif (refused := _either_method(runtime, view, request, route)) is not None:
            return refused
    if request.upgrade and not route.websocket:
        detail = f"route '{route.name}' does not take WebSocket (websocket: true)"
        return _answer(problem(501, detail, route=route.name), RequestOutcome.BAD_REQUEST, request,
                       route=route.name, close=True)
    return Matched(request, runtime.plans[route.name], view)


def _either_method(runtime: Runtime, view: RequestView, request: Request, route: Route) -> Answer | None:
    """A 400 when the route of the method an override names is not the route of the request line's:
    an upstream that honours no override acts on the request line, one that does on the override,
    and the gateway cannot tell which this one is (`method_override: ignore` says so for a route)."""
    router = runtime.router
    literal = router.match(request.method, request.hostname, request.path,
                           view.meets if router.conditional else None)
    if literal is None or literal[0] is route:
        return None  # the request line alone is refused (405, 404) or counted alike: nothing to walk past
    detail = (f"X-HTTP-Method-Override names {request.override}, which route '{route.name}' takes, while "
              f"{request.method} is route '{literal[0].name}': the upstream may act on either")
    return _answer(problem(400, detail, route=route.name), RequestOutcome.BAD_REQUEST, request, route=route.name)


def _literal_method(runtime: Runtime, view: RequestView, request: Request) -> Answer | None:
    """A 400 when no route takes the method an override names but one takes the request line's: an
    upstream that honours no override acts on the request line, so the request may not pass as
    unlimited (the check port and the middleware let a request no route takes through)."""
    router = runtime.router
    try:
        literal = router.match(request.method, request.hostname, request.path,
                               view.meets if router.conditional else None)
    except BadRequest as exc:  # the request line's route refuses it (a path number it cannot read)
        return _answer(problem(exc.status, str(exc)), RequestOutcome.BAD_REQUEST, request)
    if literal is None:
        return None
    detail = (f"X-HTTP-Method-Override names {request.override}, which no route takes on {request.path[:200]}, "
              f"while {request.method} is route '{literal[0].name}': the upstream may act on either")
    return _answer(problem(400, detail, route=literal[0].name), RequestOutcome.BAD_REQUEST, request,
                   route=literal[0].name)


def _caller_plan(runtime: Runtime, view: RequestView, request: Request) -> Answer | None:
    """Set `view.plan` from the request's API key (gateway/api_keys.py); an Answer instead when the
    key is unknown or absent and `keys.unknown` is reject (401), or not known yet (503)."""
    settings = runtime.config.keys
    assert settings is not None
    try:
        key = view.read(settings.source)
    except BadRequest as exc:
        return _answer(problem(exc.status, str(exc)), RequestOutcome.BAD_REQUEST, request)
    table = runtime.keys
    if table is None or not table.loaded:
        status, headers, body = problem(503, "API keys are not loaded yet (Redis unavailable); try again shortly")
        headers.append((b"retry-after", b"1"))
        return _answer((status, headers, body), RequestOutcome.FAILED_CLOSED, request)
    found = table.lookup(key) if key else None
    if found is None and settings.unknown == "reject":
        detail = f"no API key in {settings.source}" if not key else "unknown API key"
        status, headers, body = problem(401, detail)
        headers.append((b"www-authenticate", f'Key realm="gateway", source="{settings.source}"'.encode()))
        return _answer((status, headers, body), RequestOutcome.UNKNOWN_KEY, request)
    view.plan, view.consumer = found or ("none", None)
    return None


def _answer(response: tuple[int, Headers, bytes], outcome: RequestOutcome, request: Request | None,
            route: str = "", rule: str = "", close: bool = False) -> Answer:
    status, headers, body = response
    request_id = usable_request_id(request.request_id) if request is not None else None
    return Answer(status, headers, body, outcome, route, rule, close, request_id)


def _refused(plan: RoutePlan, rules: list[Rule], keys: list[str], parts: list[tuple[bytes, ...] | None],
             decision: Decision, decided_by: DecidedBy, request_id: bytes | None) -> Answer:
    by = decision.refused_by
    assert by is not None
    rule = rules[by]
    status, headers, body = refusal(plan.route, rules, decision)
    at = next(i for i, r in enumerate(plan.rules) if r.name == rule.name)  # rule: maybe overridden
    identity = shown(parts[at] or (), plan.readable[at])  # a refusing rule was counted: its parts were read
    return Answer(status, headers, body, RequestOutcome.REFUSED, plan.route.name, rule.name, False,
                  usable_request_id(request_id), decided_by, identity)


def identify(plan: RoutePlan, view: RequestView, overrides: RouteTable | None = None,
             known: KnownIdentities | None = None) -> Identified:
    """The request's rules, keys and costs, each rule as overridden for its identity where it is
    (gateway/overrides.py). Raises IdentityMissing or BadRequest. With `known`, identities seen
    before come to what they came to then (gateway/known_identities.py); none of it is ever
    mutated by who reads it."""
    read = [rule_identity(rule, view) for rule in plan.rules]
    if known is None or overrides or not plan.costs_fixed:
        return _identify(plan, view, overrides, read)
    key = (plan.route.name, *read)
    found = known.get(key)
    if found is None:
        found = _identify(plan, view, None, read)
        known.put(key, found)
    return found


def _identify(plan: RoutePlan, view: RequestView, overrides: RouteTable | None,
              read: list[tuple[bytes, ...] | None]) -> Identified:
    rules: list[Rule] = []
    keys: list[str] = []
    costs: list[int | None] = []
    args, shard = plan.args, 0
    for i, parts in enumerate(read):
        if i == 0 and plan.shards > 1:  # the first rule's identity picks the shard (gateway.keys)
            shard = plan.shard_of(parts)
            args = plan.shard_args[shard]
        found = keyed(plan, i, token_of(plan, i, parts), shard, overrides) if parts is not None else None
        if found is None or found.unlimited:  # no identity (on_missing: skip), or none for this one: it sits out
            keys.append(plan.shard_prefix_keys[shard][i])
            costs.append(None)
            continue
        if found.override is not None:
            args = (*args[:i], found.spec, *args[i + 1:])
        rules.append(found.rule)
        keys.append(found.key)
        costs.append(_cost(found.rule, view))
    return Identified(rules, keys, costs, args, shard, read)


def _held_decision(runtime: Runtime, plan: RoutePlan, rules: list[Rule], keys: list[str],
                   costs: list[int | None]) -> Decision | None:
    """The refusal held for these keys and costs, counted; None if none holds."""
    decision = runtime.refusals.answer(keys, costs) if rules else None
    if decision is None or decision.refused_by is None:
        return None
    count_held(plan.route.name, rules, decision)
    return decision


async def _read_prefix(receive: Receive, limit: int, timeout: float) -> tuple[bytes | None, bool]:
    """Read more than `limit` bytes of the body, or all of it (whole messages); None if the client
    went away. Raises TimeoutError when the body pauses longer than `timeout`."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more and size <= limit:
        async with asyncio.timeout(timeout):  # (3.11's wait_for drops a cancel that meets a message)
            message = await receive()
        if message["type"] == "http.disconnect":
            return None, False
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), more


def _cost(rule: Rule, view: RequestView) -> int:
    if rule.reserve_field is not None:  # a token budget: what the upstream may generate
        return reserve(rule, view)
    header = rule.cost_header
    if header is None:
        return rule.cost
    raw = view.header(header.lower().encode())
    if raw is None:
        return rule.cost
    text = raw.strip()
    if not text.isdigit() or len(text) > 10 or not 0 < int(text) <= MAX_COST_HEADER:
        raise BadRequest(f"header {header} must be a whole number from 1 to {MAX_COST_HEADER}")
    return int(text)

