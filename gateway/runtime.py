"""One configuration in force: compiled routes, per-route rule plans, upstream pools, limiter.

A reload builds a new Runtime and swaps it in; requests hold the Runtime they started with, and
the old one closes what the new one does not reuse once its last request has finished.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from gateway import metrics, tracing
from gateway.api_keys import KeyTable
from gateway.breaker import Breaker, BreakerState
from gateway.config import Config, RedisSettings
from gateway.identity import JwtVerifier
from gateway.known_identities import KnownIdentities
from gateway.leases import Leases
from gateway.limiter import Limiter
from gateway.match import Router
from gateway.overrides import RouteTable
from gateway.plan import RoutePlan, route_plan
from gateway.protect import Guard, guards_for
from gateway.proxy import UpstreamClient
from gateway.redis import CONNECT_TIMEOUT, make_runner
from gateway.refusals import LocalRefusals
from gateway.repeats import Repeats
from gateway.settlement import Settler


@dataclass
class Runtime:
    config: Config
    redis: RedisSettings
    limiter: Limiter
    router: Router
    plans: dict[str, RoutePlan]
    clients: dict[str, UpstreamClient]
    jwt: JwtVerifier | None
    refusals: LocalRefusals = field(default_factory=LocalRefusals)  # this config's, this worker's
    settler: Settler | None = None  # charges and refunds after the answer (gateway/settlement.py)
    leases: Leases | None = None    # concurrency slots held and given back (gateway/leases.py)
    repeats: Repeats = field(default_factory=Repeats)  # ... and the requests they were held for
    known: KnownIdentities = field(default_factory=KnownIdentities)  # identities' keys (gateway/known_identities.py)
    overrides: dict[str, RouteTable] = field(default_factory=dict)  # per route: gateway/overrides.py
    keys: KeyTable | None = None  # the deployment's API keys, when the config has `keys:` (gateway/api_keys.py)
    guards: dict[str, Guard] = field(default_factory=dict)  # per protected route: its limit in flight (protect:)
    in_flight: int = 0
    retired: bool = False
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.retired and self.in_flight == 0:
            self.drained.set()

    async def close(self, successor: Runtime | None = None) -> None:
        """The end of a runtime, in the one drain order: the last answers' charges and refunds, the
        last requests' slots and protected places reach Redis, then the upstream pools and the Redis
        connections close. With a `successor` (a reload's): what it took over stays open, its
        upstream pools and protect limits and, on the same Redis, the limiter and the charges still
        on their way through it."""
        same_redis = successor is not None and successor.limiter is self.limiter
        if not same_redis:
            if self.settler is not None:
                await self.settler.drain()
            if self.leases is not None:
                await self.leases.drain()
        kept = set(successor.guards.values()) if successor is not None else set()
        for guard in set(self.guards.values()) - kept:
            await guard.drain()
        for name, client in self.clients.items():
            if successor is None or successor.clients.get(name) is not client:
                await client.close()
        if not same_redis:
            await self.limiter.close()


def new_limiter(redis: RedisSettings) -> Limiter:
    """A limiter on `redis`, reporting its latency and breaker state to the metrics."""
    return tracing.limiter(Limiter(
        make_runner(redis), Breaker(), observe=_observe_redis, on_breaker=_breaker_changed,
        on_open_time=metrics.BREAKER_OPEN.inc, probe_timeout=max(CONNECT_TIMEOUT, 4 * redis.timeout)))


def _observe_redis(seconds: float, ok: bool) -> None:
    metrics.redis_latency("ok" if ok else "error").observe(seconds)


def _breaker_changed(state: BreakerState) -> None:
    metrics.BREAKER.set(int(state))


def build_runtime(
    config: Config,
    redis: RedisSettings,
    limiter: Limiter,
    reuse: dict[str, UpstreamClient] | None = None,
    transport: str = "lean",
    guards: dict[str, Guard] | None = None,
) -> Runtime:
    reuse = reuse or {}
    clients: dict[str, UpstreamClient] = {}
    for name, upstream in config.upstreams.items():
        old = reuse.get(name)
        same = old is not None and old.upstream == upstream and old.kind == transport
        clients[name] = old if old is not None and same else UpstreamClient(upstream, transport)
    plans: dict[str, RoutePlan] = {}
    # a route matched on a JWT claim: which route a request takes depends on the clock (the token's
    # exp), so no request is kept as a repeat (gateway/repeats.py)
    matches_jwt = any(route.when.jwt for route in config.routes)
    for route in config.routes:
        client = clients[route.upstream.name] if route.upstream else None
        plan = route_plan(route, redis.key_prefix, client)
        plans[route.name] = replace(plan, repeatable=False) if matches_jwt else plan
    for domain in config.rls:  # routes of their own, which no HTTP request matches
        plans[domain.route.name] = route_plan(domain.route, redis.key_prefix, None)
    # a reload keeps a limit whose protect: is unchanged
    guards = guards_for(config.routes, guards or {}, limiter, redis.key_prefix)
    uses_jwt = any(s.kind == "jwt" for r in config.routes for rule in r.limits for s in rule.by) or any(
        r.when.jwt for r in config.routes) or any(p.when.jwt for g in guards.values() for p in g.protect.priorities)
    refusals = LocalRefusals(config.local_refusals_max, config.local_refusals_hold)
    return Runtime(
        config=config,
        redis=redis,
        limiter=limiter,
        router=Router(config.routes),
        plans=plans,
        clients=clients,
        jwt=JwtVerifier(config.jwt) if uses_jwt else None,
        refusals=refusals,
        settler=Settler(limiter, refusals),
        leases=Leases(limiter),
        guards=guards,
    )
