"""The ways a request is answered without ASGI messages: `EarlyAnswer`, the hook that answers a
request before the application is entered, and the turns of the event loop a connection answered
early then sits out (`STEP_ASIDE`, counted by `Turns`), so that a flood answered from memory never
fills the turns an honest request needs; and `Door`, the one endpoint of a port whose every answer
is whole (the check port's), called with the request and returning its answer."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.http.exchange import Headers

STEP_ASIDE = 8  # turns of the event loop a connection answered early waits before it is read again

EarlyAnswer = Callable[[dict[str, Any]], tuple[int, Headers, bytes] | None]
Receive = Callable[[], Awaitable[dict[str, Any]]]
# A port's one endpoint, when its answers are whole: (scope, receive) -> (status, headers, body),
# which the server writes as one head and body; None: nothing to send (the client has gone).
Door = Callable[[dict[str, Any], Receive], Awaitable[tuple[int, Headers, bytes] | None]]

log = logging.getLogger("gateway.http")


class Aside(Protocol):
    """A connection sitting turns out."""

    transport: asyncio.Transport

    def step_back(self) -> None: ...


class Turns:
    """Counts the turns of one event loop while connections sit some out (STEP_ASIDE): one
    callback a turn whatever the number of connections waiting, and no system call."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turns] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Turns:
        turns = cls._of.get(loop)
        if turns is None:
            turns = cls._of[loop] = cls(loop)
        return turns

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.turn = 0
        self.waiting: deque[tuple[int, Aside]] = deque()  # in the order they are due
        self.ticking = False

    def wait(self, connection: Aside, turns: int) -> None:
        """Call `connection.step_back()` once `turns` turns of the loop have passed."""
        self.waiting.append((self.turn + turns, connection))
        if not self.ticking:
            self.ticking = True
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        waiting = self.waiting
        while waiting and waiting[0][0] <= self.turn:
            connection = waiting.popleft()[1]
            try:
                connection.step_back()
            except Exception:  # one connection's failure never strands the others
                log.exception("resuming a connection failed; it is closed")
                connection.transport.close()
        if waiting:
            self.loop.call_soon(self._tick)  # runs in the next turn: callbacks added now wait for it
        else:
            self.ticking = False
