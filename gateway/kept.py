"""A Redis call that takes something (a concurrency slot, a fleet's place, a unit to refund) is
run to its end even when its caller's task is cancelled meanwhile (the client left): Redis applies
a call it was sent whether or not anyone waits for the reply, so what it took is given back by
`abandoned`, called with the finished call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def kept(call: Awaitable[T], abandoned: Callable[[asyncio.Future[T]], None]) -> T:
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(abandoned)
        raise
