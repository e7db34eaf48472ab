"""The protobuf messages of Envoy's rate limit service (`envoy.service.ratelimit.v3`) and of gRPC's
health service (`grpc.health.v1`), built from descriptors written here instead of protoc output.

Only what the service reads and writes is declared, with the field numbers of Envoy's own .proto
files (envoy/service/ratelimit/v3/rls.proto, envoy/extensions/common/ratelimit/v3/ratelimit.proto,
envoy/config/core/v3/base.proto); the protobuf runtime skips the fields left out when it parses a
message, as it does for fields a newer peer adds. Enums are declared as int32, which they are on
the wire. The messages live in a pool of their own, so a process that also loads Envoy's generated
modules sees no clash.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory, wrappers_pb2

F = descriptor_pb2.FieldDescriptorProto
_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(duration_pb2.DESCRIPTOR.serialized_pb)
_POOL.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)

# (name, number, type, label, type_name)
Field = tuple[str, int, int, int, str]
ONE, MANY = F.LABEL_OPTIONAL, F.LABEL_REPEATED


def _message(parent: Any, name: str, fields: list[Field]) -> Any:
    message = parent.add(name=name)
    for field_name, number, kind, label, type_name in fields:
        added = message.field.add(name=field_name, number=number, type=kind, label=label)
        if type_name:
            added.type_name = type_name
    return message


def _file(name: str, package: str, messages: dict[str, list[Field]], nested: dict[str, dict[str, list[Field]]],
          dependencies: tuple[str, ...] = ()) -> None:
    proto = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3")
    proto.dependency.extend(dependencies)
    for message_name, fields in messages.items():
        outer = _message(proto.message_type, message_name, fields)
        for inner_name, inner_fields in nested.get(message_name, {}).items():
            _message(outer.nested_type, inner_name, inner_fields)
    _POOL.Add(proto)


_COMMON = "envoy.extensions.common.ratelimit.v3"
_file("envoy/extensions/common/ratelimit/v3/ratelimit.proto", _COMMON, {
    "RateLimitDescriptor": [
        ("entries", 1, F.TYPE_MESSAGE, MANY, f".{_COMMON}.RateLimitDescriptor.Entry"),
        ("limit", 2, F.TYPE_MESSAGE, ONE, f".{_COMMON}.RateLimitDescriptor.RateLimitOverride"),
        ("hits_addend", 3, F.TYPE_MESSAGE, ONE, ".google.protobuf.UInt64Value"),
    ],
}, {"RateLimitDescriptor": {
    "Entry": [("key", 1, F.TYPE_STRING, ONE, ""), ("value", 2, F.TYPE_STRING, ONE, "")],
    "RateLimitOverride": [("requests_per_unit", 1, F.TYPE_UINT32, ONE, ""), ("unit", 2, F.TYPE_INT32, ONE, "")],
}}, ("google/protobuf/wrappers.proto",))

_RLS = "envoy.service.ratelimit.v3"
_file("envoy/service/ratelimit/v3/rls.proto", _RLS, {
    "RateLimitRequest": [
        ("domain", 1, F.TYPE_STRING, ONE, ""),
        ("descriptors", 2, F.TYPE_MESSAGE, MANY, f".{_COMMON}.RateLimitDescriptor"),
        ("hits_addend", 3, F.TYPE_UINT32, ONE, ""),
    ],
    "RateLimitResponse": [
        ("overall_code", 1, F.TYPE_INT32, ONE, ""),
        ("statuses", 2, F.TYPE_MESSAGE, MANY, f".{_RLS}.RateLimitResponse.DescriptorStatus"),
        ("response_headers_to_add", 3, F.TYPE_MESSAGE, MANY, f".{_RLS}.RateLimitResponse.HeaderValue"),
        ("request_headers_to_add", 4, F.TYPE_MESSAGE, MANY, f".{_RLS}.RateLimitResponse.HeaderValue"),
    ],
}, {"RateLimitResponse": {
    "RateLimit": [("requests_per_unit", 1, F.TYPE_UINT32, ONE, ""), ("unit", 2, F.TYPE_INT32, ONE, ""),
                  ("name", 3, F.TYPE_STRING, ONE, "")],
    "DescriptorStatus": [
        ("code", 1, F.TYPE_INT32, ONE, ""),
        ("current_limit", 2, F.TYPE_MESSAGE, ONE, f".{_RLS}.RateLimitResponse.RateLimit"),
        ("limit_remaining", 3, F.TYPE_UINT32, ONE, ""),
        ("duration_until_reset", 4, F.TYPE_MESSAGE, ONE, ".google.protobuf.Duration"),
    ],
    # envoy.config.core.v3.HeaderValue: the same fields and numbers
    "HeaderValue": [("key", 1, F.TYPE_STRING, ONE, ""), ("value", 2, F.TYPE_STRING, ONE, "")],
}}, (f"{_COMMON.replace('.', '/')}/ratelimit.proto", "google/protobuf/duration.proto"))

_file("grpc/health/v1/health.proto", "grpc.health.v1", {
    "HealthCheckRequest": [("service", 1, F.TYPE_STRING, ONE, "")],
    "HealthCheckResponse": [("status", 1, F.TYPE_INT32, ONE, "")],
}, {})


def _class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(name))


RateLimitRequest = _class(f"{_RLS}.RateLimitRequest")
RateLimitResponse = _class(f"{_RLS}.RateLimitResponse")
RateLimitDescriptor = _class(f"{_COMMON}.RateLimitDescriptor")
HealthCheckRequest = _class("grpc.health.v1.HealthCheckRequest")
HealthCheckResponse = _class("grpc.health.v1.HealthCheckResponse")

# RateLimitResponse.Code
UNKNOWN, OK, OVER_LIMIT = 0, 1, 2
# RateLimitResponse.RateLimit.Unit (and envoy.type.v3.RateLimitUnit): seconds per unit
UNIT_SECONDS = {1: 1, 2: 60, 3: 3600, 4: 86400, 7: 7 * 86400}
UNIT_NAMES = {"second": 1, "minute": 2, "hour": 3, "day": 4, "week": 7}
# HealthCheckResponse.ServingStatus
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3
