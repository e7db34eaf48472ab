"""What every door does around one request, the same for the proxy and check endpoints and the
in-process middleware: the runtime it started with is held until it ends (a reload waits for it to
drain), its result is accounted once (metrics, access log, /top) with the status that was sent, a
call cancelled on the way (the client left, the drain ended) is accounted 499, and a protected
upstream's place it held is given back.

    with Envelope(runtime, accounting, scope) as envelope:
        envelope.result = await decide(...)
        envelope.status = await send_answer(...)
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from starlette.types import Scope

from gateway.accounting import Accounting
from gateway.outcome import GONE, Admit, Answer
from gateway.runtime import Runtime


class Envelope:
    __slots__ = ("accounting", "request_id", "result", "runtime", "scope", "started", "status")

    def __init__(self, runtime: Runtime, accounting: Accounting, scope: Scope) -> None:
        self.runtime = runtime
        self.accounting = accounting
        self.scope = scope            # the request as accounted (the check port's: the original's)
        self.result: Admit | Answer = GONE  # until decided: a call cancelled before it was
        self.status = 499             # until an answer is sent
        self.request_id = b""         # b"": the access log makes one (a check answers none)
        self.started = 0.0

    def __enter__(self) -> Envelope:
        self.runtime.enter()
        self.started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if kind is None or issubclass(kind, asyncio.CancelledError):
                status = 499 if kind is not None else self.status
                self.accounting.account(self.runtime.config, self.scope, self.request_id,
                                        self.result, status, self.started)
        finally:
            result = self.result
            if isinstance(result, Admit) and result.slot is not None:
                result.slot.release()  # its place in a protected upstream's limit (gateway/protect.py)
            self.runtime.leave()
