"""redis-py's asyncio connection classes, packing commands with hiredis as its sync client does,
and reading a batch's replies in one pass of its hiredis reader.

redis-py's sync Connection packs a command with `hiredis.pack_command` (its HiredisRespSerializer)
when hiredis is installed; its asyncio connections still pack in Python (redis/redis-py#4176,
fix proposed in PR #4191), and on the decision path that was the largest single cost of a call.
These subclasses plug the library's own serializer in at its seam, `pack_command`, and are given
to redis-py through its `connection_class` option.

`read_replies` reads the replies of a pipelined batch: its parser's hiredis reader gives every reply
already read before the socket is read again, where `read_response` per reply walks five frames
of redis-py for each (its timeout and push-notification checks, which a batch on a connection of
its own, under the batch's deadline, does not use): 9 of a check-port decision's 80 µs at 50
connections. With any other parser (hiredis missing) it is `read_response` per reply.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis import exceptions as rx
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
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

    async def read_replies(self: Any, count: int, out: list[Any]) -> None:
        """Read `count` replies, in order, onto `out`: an error reply (typed by redis-py's parser:
        NoScriptError, MovedError, ...) is that command's result. Anything else raises, with the
        replies read so far in `out` and the connection disconnected, as `read_response` does."""
        parser = self._parser
        if type(parser) is not _AsyncHiredisParser:
            for _ in range(count):
                try:
                    out.append(await self.read_response())
                except rx.ResponseError as exc:
                    out.append(exc)
            return
        end = len(out) + count
        try:
            if not parser._connected:
                raise rx.ConnectionError("Connection closed by server.")
            reader: Any = parser._reader  # made by on_connect
            push = parser._hiredis_PushNotificationType
            while len(out) < end:
                reply = reader.gets()
                if reply is NOT_ENOUGH_DATA:
                    await parser.read_from_socket()
                elif isinstance(reply, rx.ConnectionError):
                    raise reply
                elif push is not None and isinstance(reply, push):  # RESP3: not a command's reply
                    await parser.handle_push_response(reply)
                else:
                    out.append(reply)
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise rx.ConnectionError(f"Error while reading from {self._host_error()} : {exc.args}") from exc
        except BaseException:
            await self.disconnect(nowait=True)
            raise


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
