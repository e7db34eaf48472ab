"""redis-py's asyncio connection classes, packing commands with hiredis as its sync client does.

redis-py's sync Connection packs a command with `hiredis.pack_command` (its HiredisRespSerializer)
when hiredis is installed; its asyncio connections still pack in Python (redis/redis-py#4176,
fix proposed in PR #4191), and on the decision path that was the largest single cost of a call.
These subclasses plug the library's own serializer in at its seam, `pack_command`, and are given
to redis-py through its `connection_class` option. Nothing else changes.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection
from redis.connection import HiredisRespSerializer

from gateway.redis.batch import EVALSHA

_PACKER = HiredisRespSerializer()


class HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        if args[0] is EVALSHA:  # a decision (gateway/redis/batch.py): bytes, str and int only, as
            return [hiredis.pack_command(args)]  # the serializer's own checks would leave them
        return _PACKER.pack(*args)  # type: ignore[no-any-return]


class TcpConnection(HiredisPacking, Connection):
    pass


class TlsConnection(HiredisPacking, SSLConnection):
    pass


class UnixConnection(HiredisPacking, UnixDomainSocketConnection):
    pass


class SentinelConnection(HiredisPacking, SentinelManagedConnection):
    pass


class SentinelTlsConnection(HiredisPacking, SentinelManagedSSLConnection):
    pass


def for_url(url: str) -> type[Connection] | type[UnixDomainSocketConnection]:
    """The class for a redis://, rediss:// or unix:// URL."""
    if url.startswith("unix://"):
        return UnixConnection
    return TlsConnection if url.startswith("rediss://") else TcpConnection
