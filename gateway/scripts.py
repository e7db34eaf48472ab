"""Lua scripts, read from the package (or written from its fragments) and called by SHA with a fallback to EVAL.

A `NOSCRIPT` reply (after `SCRIPT FLUSH`, a restart or a failover to a replica that never saw the
script) is answered by sending the same call as `EVAL`, which also caches the script again; no
caller sees it.
"""

from __future__ import annotations

import hashlib
import time
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.errors import RedisUnavailable
from gateway.redis_client import RedisConnection, RedisReplyError


def read_script(name: str) -> str:
    try:
        return resources.files("gateway.lua").joinpath(f"{name}.lua").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parent.parent / "lua" / f"{name}.lua").read_text()


class Script:
    def __init__(self, name: str, source: str | None = None) -> None:
        self.name = name
        self.source = read_script(name) if source is None else source
        self.sha = hashlib.sha1(self.source.encode()).hexdigest().encode()

    async def run(
        self, conn: RedisConnection, keys: list[str], args: list[bytes | str | int]
    ) -> Any:
        started = time.monotonic()
        reply = await conn.call(b"EVALSHA", self.sha, len(keys), *keys, *args)
        if isinstance(reply, RedisReplyError) and str(reply).startswith("NOSCRIPT"):
            left = conn.timeout - (time.monotonic() - started)  # one decision, one time budget
            if left <= 0:
                raise RedisUnavailable("Redis did not answer in time")
            reply = await conn.call(b"EVAL", self.source, len(keys), *keys, *args, timeout=left)
        return reply
