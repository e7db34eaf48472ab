"""What follows an admission, written once for every entry point: the proxy endpoint, the
middleware (HTTP and WebSocket) and the check endpoint all run it as

    async with Admitted(runtime, admit) as after:
        ... forward, call the app, or answer the proxy in front
        after.answered(status, declared)   # as the answer's head arrives (counting by the answer)
        after.status = ...                  # or the status the request ended with

Entering holds the request's concurrency slots (gateway/leases.py) and waits a leaky bucket's
delay; leaving, however the request ends (an answer, an error, a client that left and had its call
cancelled), settles the rules counted by the answer (gateway/settlement.py) with the last status
(499 when no answer came: `refund_on: [499]`), then gives the slots back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.usage import AnswerUsage

if TYPE_CHECKING:
    from gateway.leases import Lease, Leases
    from gateway.outcome import Admit
    from gateway.runtime import Runtime
    from gateway.settlement import Settlement, Settler

UNANSWERED = 499  # nginx's status for a client that left before its answer


class Admitted:
    __slots__ = ("_declared", "_lease", "_leases", "_settlement", "_settler", "delay_ms", "status", "usage")

    def __init__(self, runtime: Runtime, admit: Admit) -> None:
        self._lease: Lease | None = admit.lease
        self._leases: Leases | None = runtime.leases if admit.lease is not None else None
        self._settlement: Settlement | None = admit.settlement
        self._settler: Settler | None = runtime.settler if admit.settlement is not None else None
        self.delay_ms = admit.delay_ms
        self.status = UNANSWERED  # what the request is settled with when nothing else is said
        # token budgets settle when the answer's body has ended, by what it said it used
        self.usage = AnswerUsage(admit.plan.usage_paths) if admit.settlement and admit.plan.usage_paths else None
        self._declared: Mapping[str, str] | None = None

    @property
    def settles(self) -> bool:
        """Does the answer change what this request is charged (count_on, refund_on, a response cost)?"""
        return self._settler is not None

    async def __aenter__(self) -> Admitted:
        if self._leases is not None and self._lease is not None:
            self._leases.hold(self._lease)  # its slots while in flight (a tunnel too)
        if self.delay_ms > 0:  # its place in a leaky bucket's queue
            try:
                await asyncio.sleep(self.delay_ms / 1000)
            except BaseException:  # the client left while it waited
                self.end()
                raise
        return self

    def answered(self, status: int, declared: Mapping[str, str] | None, content_type: str | None = None) -> None:
        """The answer's head: what depends on it is charged or refunded now, before its body (with
        a token budget, once the body has ended: `usage` reads it as it goes by)."""
        self.status = status
        if self.usage is not None:
            self._declared = declared
            self.usage.head(content_type if content_type is not None else (declared or {}).get("content-type", ""))
            return
        if self._settler is not None and self._settlement is not None:
            self._settler.settle(self._settlement, status, declared)

    async def __aexit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """Settle with the last status and give the slots back (what leaving the context does)."""
        if self._settler is not None and self._settlement is not None:  # once: a no-op when the head settled it
            self._settler.settle(self._settlement, self.status, self._declared,
                                 self.usage.used if self.usage is not None else None)
        if self._leases is not None and self._lease is not None:
            self._leases.release(self._lease)
