"""Script calls of one event-loop tick, sent together: the batching every runner shares.

`Batcher.run()` queues one call and returns its future; the first call of a tick starts a task whose
first step, at the end of the tick, takes every queued call (`_send`, per topology) and
writes them on one redis-py `Connection` as one packed write and reads their replies in order
(`exchange`). Every caller gets its own result or its own exception (a
gateway.errors.RedisUnavailable subclass).

Time: a batch's budget (redis.timeout) starts when it is sent: connecting, the exchange, a NOSCRIPT
reload, redirections and their retries all fit in it, and when it passes the batch's task is
cancelled and every call still waiting fails with RedisTimeout. After a batch Redis left
unanswered, the calls queued meanwhile keep the budget that began when the first of them was
queued, so a Redis that stopped answering costs a call one budget, not two. One timer per runner
watches the deadlines (`_expire`), armed for the earliest batch in flight and moved on when it
fires (or sooner, for a batch whose deadline comes first), so a batch costs no timer
of its own (`asyncio.timeout_at` per batch took a timer handle, a Timeout and its cancellation:
4.5 µs of a lone call's client CPU, measured on a hot core).
Connecting has redis-py's socket_connect_timeout (the same budget) below it; reading has no
socket_timeout of its own: redis-py would put a timer around every write and every reply (measured
on a lone call through its Connection, Redis on the same core: 22 against 11 µs of client CPU) for
a bound the batch's deadline already sets. A
cancelled exchange disconnects its connection (redis-py does that on any exception while reading),
so no reply is ever read by the wrong caller.

At most `max_batches` batches are in flight (one server: one, on its one connection; Cluster: 16,
each node's part on a connection of that node); calls queued meanwhile wait for the next free one
and so ride in bigger batches when Redis is busy or slow (the deadline is still that of the first
of them).

The budget is for Redis's time, not the event loop's. A saturated worker runs tens of milliseconds
of other requests' work between a reply's arrival and the step that reads it, and uvloop runs a due
timer before it polls the sockets at all. So a deadline that passes is checked against the wire: a
batch whose reply is already waiting (in the socket, or read and not yet parsed: `reply_waiting`),
or that read replies since its budget began (a large pipeline's come as Redis works through it), was
answered in time and gets a new budget instead of failing. Only a batch that Redis leaves unanswered
for a whole budget fails, and only calls queued behind one that failed fail without being sent, with
that batch's failure (the same exception object): the breaker counts a stall once per batch Redis
left unanswered, not again for the calls that waited behind it. Those calls end that batch's turn:
the next batch has a budget of its own from when it is sent, so a loop that stays busier than the
budget after the stall never fails a call Redis would answer. Counting the loop's time had failed
decisions Redis answered in under a millisecond whenever the worker was saturated; the breaker
opened, the fail-open route then forwarded everything, the loop got busier still, and nothing came
back. A batch that spent most of its budget waiting for its first step did the same more quietly:
sent with 2 ms of a 20 ms budget left, it failed if Redis took 3, and one failed batch is enough
calls to open the breaker.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Sequence
from typing import Any

from redis.asyncio.connection import AbstractConnection

from gateway.errors import RedisTimeout
from gateway.redis.errors import REDIS_FAILURES, convert
from gateway.scripts import Script

Arg = bytes | str | int

EVALSHA = b"EVALSHA"  # bytes: redis-py's packer looks for a space in a str command name


async def exchange(connection: AbstractConnection, commands: Sequence[tuple[Arg, ...]],
                   replies: list[Any] | None = None) -> list[Any]:
    """Write `commands` on `connection` in one packed write and read one reply per command, in
    order, into `replies`: an error reply (a ResponseError, typed by redis-py's parser: NoScriptError,
    MovedError, ...) is that command's result and the others stand. Anything else raises, with the
    replies read so far in `replies` and the connection disconnected by redis-py. A batch of one
    (a lone decision) takes the short way: no list of parts to build and join."""
    out: list[Any] = [] if replies is None else replies
    if not connection.is_connected:
        # connect() itself: send_packed_command would connect below it, where a Sentinel-managed
        # connection does not ask the sentinels for the primary
        await connection.connect()
    if len(commands) == 1:
        await connection.send_packed_command(connection.pack_command(*commands[0]), check_health=False)
    else:
        packed = [part for command in commands for part in connection.pack_command(*command)]
        await connection.send_packed_command(packed, check_health=False)
    await connection.read_replies(len(commands), out)  # type: ignore[attr-defined]
    return out


async def warm(connection: AbstractConnection, scripts: Sequence[Script]) -> None:
    """The breaker's probe on one connection: connect, `SCRIPT LOAD` each script, see a PING
    answered. An error reply raises (redis-py's ResponseError), as a failure does."""
    replies = await exchange(connection, [*(("SCRIPT", "LOAD", script.source) for script in scripts), ("PING",)])
    failed = next((reply for reply in replies if isinstance(reply, BaseException)), None)
    if failed is not None:
        raise failed


def reply_waiting(connection: AbstractConnection) -> bool:
    """Has Redis answered on `connection`: bytes read from the socket and not parsed yet, or bytes
    in the socket that the loop has not read yet? (Asked only when a deadline passes.)"""
    reader: Any = getattr(connection, "_reader", None)
    writer: Any = getattr(connection, "_writer", None)
    if reader is None or writer is None:  # not connected (yet)
        return False
    if reader._buffer:  # asyncio.StreamReader's; redis-py's own can_read() reads it too
        return True
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed meanwhile
        return False


class QueuedCall:
    """One script call waiting for its reply."""

    __slots__ = ("command", "future", "reply", "script")

    def __init__(self, script: Script, command: tuple[Arg, ...], future: asyncio.Future[Any]) -> None:
        self.script = script
        self.command = command  # (b"EVALSHA", sha, numkeys, *keys, *args)
        self.future = future
        self.reply: BaseException | None = None  # an error reply held back while the runner decides

    def settle(self, result: Any) -> None:
        """Hand over a reply: a list, or an exception redis-py put in its place."""
        future = self.future
        if future.done():  # the caller went away (its request was cancelled)
            return
        if isinstance(result, BaseException):
            future.set_exception(convert(result) if isinstance(result, REDIS_FAILURES) else result)
        else:
            future.set_result(result)

    @property
    def keys(self) -> tuple[Arg, ...]:
        numkeys = self.command[2]
        assert isinstance(numkeys, int)
        return self.command[3 : 3 + numkeys]


class Batcher:
    max_batches = 16

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pending: list[QueuedCall] = []
        self._deadline = 0.0
        self._next: asyncio.Task[None] | None = None  # the next batch's task, until its first step
        self._in_flight: dict[asyncio.Task[None], float] = {}  # batch -> its deadline, oldest first
        self._expired: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        # the failure of the last batch that ended, if Redis left it unanswered (see the module's doc)
        self._unanswered: BaseException | None = None
        self._progress: dict[asyncio.Task[None], int] = {}  # replies a batch had read at its last deadline

    def failure_domain(self, key: str) -> int | None:
        """One server (or one Sentinel-named primary) holds every key: one domain."""
        return None

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> asyncio.Future[Any]:
        """Queue one EVALSHA; the future resolves to its reply. No coroutine frame per call."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            self._deadline = loop.time() + self.timeout
        self._pending.append(QueuedCall(script, (EVALSHA, script.sha, len(keys), *keys, *args), future))
        if self._next is None and len(self._in_flight) < self.max_batches:
            self._start(loop)
        return future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The task of the next batch. Its first step runs at the end of this tick, and takes every
        call queued until then (one loop turn sooner than a flush callback creating the task)."""
        self._next = loop.create_task(self._execute(self._deadline))

    def _expire(self) -> None:
        """Cancel the batches whose deadline passed with no reply waiting; give those with one a
        new budget; watch the next deadline. Only batches that took their first step are watched:
        uvloop runs a timer that fell due before the ready callbacks of its loop turn, and a task
        cancelled before its first step would never run the code that lets the next batch start."""
        self._watchdog = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        upcoming = None
        for task, deadline in self._in_flight.items():
            if task in self._expired:
                continue
            if deadline <= now:
                read = self._replies_read(task)
                if read <= self._progress.get(task, 0) and not self._replied(task):
                    self._expired.add(task)
                    task.cancel()
                    continue
                self._progress[task] = read  # Redis answers: the rest of its replies get a budget
                deadline = self._in_flight[task] = now + self.timeout
            if upcoming is None or deadline < upcoming:
                upcoming = deadline
        if upcoming is not None:
            self._watchdog = loop.call_at(upcoming, self._expire)

    def _replied(self, task: asyncio.Task[None]) -> bool:
        """Is a reply to `task`'s batch waiting on every connection the batch still reads?"""
        return False

    def _replies_read(self, task: asyncio.Task[None]) -> int:
        """Replies of `task`'s batch read so far. Redis writes a large pipeline's replies as it
        works through it, so a batch still reading them when its budget ends is being answered."""
        return 0

    async def _execute(self, deadline: float) -> None:
        self._next = None
        batch, self._pending = self._pending, []
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        now = loop.time()
        unanswered = self._unanswered
        if unanswered is None:
            deadline = now + self.timeout  # the time queued went on the loop's other work, not on Redis
        self._in_flight[task] = deadline
        watchdog = self._watchdog
        if watchdog is None or deadline < watchdog.when():
            if watchdog is not None:
                watchdog.cancel()
            self._watchdog = loop.call_at(deadline, self._expire)
        try:
            if unanswered is None or now < deadline:
                await self._send(batch)
                self._unanswered = None
            else:  # its calls spent their budget waiting behind a batch Redis did not answer: they fail
                # with that batch's failure, one failure for the breaker (it counts an object once).
                # What they waited for has ended: the next batch asks Redis afresh, with a budget of
                # its own, and counts for itself if Redis leaves it unanswered too.
                self._unanswered = None
                self._fail(batch, unanswered.with_traceback(None))
        except asyncio.CancelledError:
            # its deadline passed (and nothing else cancelled it): a timeout, as asyncio.timeout says
            if task in self._expired and task.uncancel() == 0:
                self._unanswered = self._timed_out()
                self._fail(batch, self._unanswered)
            else:  # the loop is shutting down: so are the callers
                for call in batch:
                    call.future.cancel()
                raise
        except REDIS_FAILURES as exc:
            self._unanswered = convert(exc)
            self._fail(batch, self._unanswered)
        except BaseException as exc:  # a bug: never leave a caller hanging
            self._fail(batch, exc)
            raise
        finally:
            del self._in_flight[task]
            self._expired.discard(task)
            self._progress.pop(task, None)
            if self._pending and self._next is None:
                self._start(loop)

    def _timed_out(self) -> RedisTimeout:
        return RedisTimeout(f"Redis did not answer within {self.timeout * 1000:.0f} ms")

    @staticmethod
    def _fail(batch: list[QueuedCall], exc: BaseException) -> None:
        for call in batch:
            if not call.future.done():
                call.future.set_exception(exc)

    async def _send(self, batch: list[QueuedCall]) -> None:
        """Send the calls and settle every one of them (the topology's part)."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Wait for the batches in flight (before closing the connections)."""
        waiting = [*self._in_flight, *([self._next] if self._next is not None else [])]
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)
