"""The batch reply reader (`read_replies`, gateway/redis/connections.py) against redis-py's own
`read_response` per reply, on a real redis-server: the same replies in the same order, error
replies typed as redis-py types them, RESP2 and RESP3, and a connection that breaks mid-batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis import exceptions as rx
from redis._parsers import _AsyncRESP3Parser

from gateway.redis.batch import EVALSHA, exchange
from gateway.redis.connections import TcpConnection
from tests.support.redis_proc import RedisProcess

SCRIPT = "if ARGV[1] == 'boom' then return redis.error_reply('BOOM nope') end return {1, tonumber(ARGV[1]), 'x'}"


def _commands(sha: str) -> list[tuple[Any, ...]]:
    """Replies of every shape a batch meets: arrays, an error reply, NOSCRIPT, a wrong type, a string."""
    return [
        (EVALSHA, sha, 0, 1), (EVALSHA, sha, 0, "boom"), (EVALSHA, "0" * 40, 0), ("SET", "replies:s", "v"),
        ("LPUSH", "replies:s", "x"), ("GET", "replies:s"), *((EVALSHA, sha, 0, n) for n in range(40)), ("PING",),
    ]


def _shape(reply: Any) -> Any:
    return (type(reply).__name__, str(reply)) if isinstance(reply, BaseException) else reply


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_batch_reads_as_redis_py_reads_it(redis_proc: RedisProcess, protocol: int) -> None:
    async def main() -> tuple[list[Any], list[Any]]:
        lean = TcpConnection(host="127.0.0.1", port=redis_proc.port, protocol=protocol)
        library = TcpConnection(host="127.0.0.1", port=redis_proc.port, protocol=protocol,
                                parser_class=_AsyncRESP3Parser)  # not hiredis: read_response per reply
        try:
            await lean.connect()  # type: ignore[no-untyped-call]
            await lean.send_command("SCRIPT", "LOAD", SCRIPT)
            sha = (await lean.read_response()).decode()
            ours = await exchange(lean, _commands(sha))
            theirs = await exchange(library, _commands(sha))
            return ours, theirs
        finally:
            await lean.disconnect()
            await library.disconnect()

    ours, theirs = asyncio.run(main())
    assert [_shape(r) for r in ours] == [_shape(r) for r in theirs]
    assert len(ours) == 47
    assert ours[0] == [1, 1, b"x"]
    assert isinstance(ours[1], rx.ResponseError) and "BOOM" in str(ours[1])
    assert isinstance(ours[2], rx.NoScriptError)
    assert isinstance(ours[4], rx.ResponseError) and "WRONGTYPE" in str(ours[4])


def test_a_connection_broken_mid_batch_raises_with_the_replies_read_so_far(redis_proc: RedisProcess) -> None:
    async def main() -> tuple[list[Any], BaseException | None, bool]:
        connection = TcpConnection(host="127.0.0.1", port=redis_proc.port)
        await connection.connect()  # type: ignore[no-untyped-call]
        await connection.send_command("CLIENT", "SETNAME", "replies-victim")
        await connection.read_response()
        replies: list[Any] = []
        failed = None
        # the second command kills this very connection, so its reply and the third never come
        try:
            await exchange(connection, [("PING",), ("CLIENT", "KILL", "SKIPME", "NO", "ID", await _own_id(redis_proc)),
                                        ("PING",)], replies)
        except BaseException as exc:
            failed = exc
        return replies, failed, connection.is_connected

    replies, failed, connected = asyncio.run(main())
    assert isinstance(failed, rx.ConnectionError)
    assert replies[:1] == [b"PONG"] and len(replies) < 3
    assert not connected  # disconnected: no later reply is read by the wrong caller


async def _own_id(redis_proc: RedisProcess) -> int:
    client = redis_proc.client()
    victim = next(c for c in client.client_list() if c.get("name") == "replies-victim")
    return int(victim["id"])
