"""A gRPC client of the rate limit service: grpcio's (its C core, not the server's h2), so the
server under test meets an HTTP/2 and gRPC implementation other than its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.rls import messages as pb
from gateway.scripts import Script

SHOULD_RATE_LIMIT = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
HEALTH = "/grpc.health.v1.Health/Check"
OK, OVER_LIMIT = pb.OK, pb.OVER_LIMIT
SECOND, MINUTE, HOUR, DAY = 1, 2, 3, 4

Entries = Sequence[tuple[str, str]]


@dataclass
class Descriptor:
    entries: Entries
    hits: int | None = None                  # the descriptor's own hits_addend
    limit: tuple[int, int] | None = None     # (requests_per_unit, unit): the descriptor's own limit


def request(domain: str, *descriptors: Entries | Descriptor, hits: int = 0) -> Any:
    message = pb.RateLimitRequest(domain=domain, hits_addend=hits)
    for item in descriptors:
        d = item if isinstance(item, Descriptor) else Descriptor(item)
        added = message.descriptors.add()
        for key, value in d.entries:
            added.entries.add(key=key, value=value)
        if d.hits is not None:
            added.hits_addend.value = d.hits
        if d.limit is not None:
            added.limit.requests_per_unit, added.limit.unit = d.limit
    return message


class RlsClient:
    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.raw = self.channel.unary_unary(SHOULD_RATE_LIMIT, request_serializer=None, response_deserializer=None)
        self.health_call = self.channel.unary_unary(HEALTH, request_serializer=None, response_deserializer=None)

    def ask(self, domain: str, *descriptors: Entries | Descriptor, hits: int = 0, timeout: float = 5.0) -> Any:
        body = request(domain, *descriptors, hits=hits).SerializeToString()
        return pb.RateLimitResponse.FromString(self.raw(body, timeout=timeout))

    def ask_raw(self, body: bytes, timeout: float = 5.0) -> Any:
        return pb.RateLimitResponse.FromString(self.raw(body, timeout=timeout))

    def health(self, service: str = "", timeout: float = 5.0) -> int:
        body = pb.HealthCheckRequest(service=service).SerializeToString()
        return int(pb.HealthCheckResponse.FromString(self.health_call(body, timeout=timeout)).status)

    def close(self) -> None:
        self.channel.close()


def codes(response: Any) -> list[int]:
    return [status.code for status in response.statuses]


def remaining(response: Any) -> list[int]:
    return [status.limit_remaining for status in response.statuses]


def error_of(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status and message of a call that must fail."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("the call succeeded")


def decision_scripts(client: Any) -> int:
    """The scripts a Redis holds, less the gateway's own for anything but a decision (the overrides'
    sync loads its script when it first runs, at a time of its own)."""
    others = [Script(path.stem).sha for path in (Path(__file__).parents[2] / "lua").glob("*.lua")
              if path.stem != "decide"]
    return int(client.info("memory")["number_of_cached_scripts"]) - int(sum(client.script_exists(*others)))
