"""gateway/redis against a real redis-server: the decisions of one tick in one pipeline, each caller
with its own answer; NOSCRIPT inside a batch; every failure a typed RedisUnavailable within the
time budget; the admin interface (ping, reset, close)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any

import pytest

from gateway.breaker import Breaker
from gateway.config import RedisSettings, Rule
from gateway.embedded import EmbeddedRedis
from gateway.errors import BreakerOpen, RedisConnectionFailed, RedisErrorReply, RedisTimeout, RedisUnavailable
from gateway.keys import state_key
from gateway.limiter import Decision, Limiter, rule_spec
from gateway.redis import CONNECT_TIMEOUT, PipelineRunner, make_runner
from gateway.redis.connections import HiredisPacking
from tests.support.patience import within
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess

QUOTA = [rule_spec(Rule("stock", (), "quota", limit=25))]


def _key() -> str:
    return state_key("rlgw", f"r{uuid.uuid4().hex[:8]}", "stock", "~")


def _commandstats(proc: RedisProcess) -> dict[str, int]:
    stats = proc.client().info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_concurrent_decisions_share_one_pipeline_and_each_gets_its_own_answer(redis_proc: RedisProcess) -> None:
    good = _key()

    async def main() -> list[Decision | BaseException]:
        runner = make_runner(RedisSettings(url=redis_proc.url, timeout=2.0))
        assert isinstance(runner, PipelineRunner)
        limiter = Limiter(runner)
        await limiter.decide(QUOTA, [_key()], [1])  # connected, script loaded
        batches = 0
        pipeline = runner._pipeline

        async def counting(commands: Sequence[tuple[bytes | str | int, ...]]) -> list[Any]:
            nonlocal batches
            batches += 1
            return await pipeline(commands)

        runner._pipeline = counting  # type: ignore[method-assign]
        calls: list[Awaitable[Any]] = [limiter.decide(QUOTA, [good], [1]) for _ in range(30)]
        script = next(iter(limiter.scripts.values())).script

        async def bad() -> Any:  # the script fails on this one
            return await runner.run(script, [_key()], [b"not a number"])

        calls.insert(7, bad())
        out = await asyncio.gather(*calls, return_exceptions=True)
        await limiter.close()
        assert batches == 1
        return out

    out = asyncio.run(main())
    assert isinstance(out[7], RedisErrorReply) and out[7].kind == "error_reply"
    answers = [d for d in out if isinstance(d, Decision)]
    assert [d.admitted for d in answers] == [True] * 25 + [False] * 5  # in the order they were asked
    assert redis_proc.client().get(good) == b"25"


def test_script_flush_in_the_middle_of_a_batch_costs_no_call_an_error() -> None:
    redis_proc = RedisProcess()  # its own: a flush on a shared server makes other tests' clients load
    redis_proc.start()           # scripts again, and their loads would be counted here
    try:
        _flushed_mid_batch(redis_proc)
    finally:
        redis_proc.stop()


def _flushed_mid_batch(redis_proc: RedisProcess) -> None:
    keys = [_key() for _ in range(40)]

    async def main() -> list[bool]:
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=2.0)))
        await limiter.decide(QUOTA, [_key()], [1])
        redis_proc.client().script_flush()
        redis_proc.client().config_resetstat()
        out = await asyncio.gather(*[limiter.decide(QUOTA, [k], [1]) for k in keys])
        await limiter.close()
        return [d.admitted for d in out]

    assert asyncio.run(main()) == [True] * 40
    stats = _commandstats(redis_proc)
    assert stats.get("script") == 1  # one SCRIPT LOAD for the batch
    assert stats.get("evalsha") == 80  # each call twice: NOSCRIPT, then its answer


async def _healthy_decision(limiter: Limiter) -> Decision:
    """A decision while Redis is well, for a test whose budget is tight. On a busy machine one may
    outlast it (the first also connects and loads the script), which is not what is under test: a
    few more tries, fewer than the failures in a row that open the breaker, counting one stall's."""
    for _ in range(limiter.breaker.failures_to_open - 2):
        try:
            return await limiter.decide(QUOTA, [_key()], [1])
        except RedisTimeout:
            continue
    return await limiter.decide(QUOTA, [_key()], [1])


def test_a_paused_redis_costs_a_decision_no_more_than_the_timeout() -> None:
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    try:
        async def main() -> list[float]:
            limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=0.05)))
            await _healthy_decision(limiter)
            os.kill(proc.process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            waited = []
            try:
                for _ in range(3):
                    started = time.perf_counter()
                    with pytest.raises(RedisTimeout) as caught:
                        await limiter.decide(QUOTA, [_key()], [1])
                    assert caught.value.kind == "timeout"
                    waited.append(time.perf_counter() - started)
                # concurrent calls queued while the first batches hang: the same bound
                started = time.perf_counter()
                out = await asyncio.gather(*[limiter.decide(QUOTA, [_key()], [1]) for _ in range(50)],
                                           return_exceptions=True)
                waited.append(time.perf_counter() - started)
                assert all(isinstance(e, RedisUnavailable) for e in out)
            finally:
                os.kill(proc.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
            # the batches cut short left the connection closed, never half-read: once the breaker
            # lets calls through again (its probe saw Redis answer), each gets its own reply
            for _ in range(round(within(10) / 0.05)):  # its probe runs every open_for (1 s)
                if limiter.breaker_state.name == "CLOSED":
                    break
                await asyncio.sleep(0.05)
            assert await _served_again(limiter)
            again = await asyncio.gather(*[limiter.decide(QUOTA, [_key()], [1]) for _ in range(20)])
            assert all(decision.admitted for decision in again)
            await limiter.close()
            return waited

        waited = asyncio.run(main())
        print("waited (s):", [round(w, 4) for w in waited])
        # the budget and some slack for a busy machine; a call waiting for the hung batch would wait
        # for ever, one bounded by redis-py's socket timeouts for seconds
        assert max(waited) < 0.05 + 0.25, waited
    finally:
        proc.stop()


def test_failures_are_typed_and_the_breaker_opens(redis_proc: RedisProcess) -> None:
    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=f"redis://127.0.0.1:{free_port()}", timeout=0.2)))
        for _ in range(limiter.breaker.failures_to_open):
            with pytest.raises(RedisConnectionFailed) as caught:
                await limiter.decide(QUOTA, [_key()], [1])
            assert caught.value.kind == "connection"
        with pytest.raises(BreakerOpen) as opened:
            await limiter.decide(QUOTA, [_key()], [1])
        assert opened.value.kind == "breaker_open"
        with pytest.raises(RedisConnectionFailed):
            await limiter.ping()
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_ping_reset_and_close(where: str) -> None:
    proc = EmbeddedRedis() if where == "unix" else RedisProcess()  # embedded: a unix socket only
    proc.start()
    try:
        key = _key()

        async def main() -> tuple[bool, bool, bool]:
            limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=1.0)))
            await limiter.ping()
            assert (await limiter.decide(QUOTA, [key], [1])).admitted
            first = await limiter.reset(key)
            second = await limiter.reset(key)
            again = (await limiter.decide(QUOTA, [key], [25])).admitted  # the whole quota again
            await limiter.close()
            return first, second, again

        assert asyncio.run(main()) == (True, False, True)
        assert proc.url.startswith("unix://" if where == "unix" else "redis://")
    finally:
        proc.stop()


@pytest.mark.parametrize(("url", "db"), [
    ("redis://:pw@h:1/5", 5), ("rediss://u:p@h:6380/2?ssl_cert_reqs=none", 2), ("unix:///tmp/r.sock?db=3", 3),
])
def test_every_url_gets_connections_that_pack_with_hiredis(url: str, db: int) -> None:
    runner = make_runner(RedisSettings(url=url, timeout=0.05))
    assert isinstance(runner, PipelineRunner)
    pool = runner.client.connection_pool
    assert issubclass(pool.connection_class, HiredisPacking)
    assert pool.connection_kwargs["db"] == db
    # connecting is bounded by the probe's budget, not a decision's (a decision's connect is bounded
    # by its batch's deadline)
    assert pool.connection_kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT
    packed = pool.make_connection().pack_command(b"EVALSHA", b"ab", 1, "k", 7)  # type: ignore[no-untyped-call]
    assert packed == [b"*5\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n$1\r\n7\r\n"]


def test_decisions_of_many_ticks_go_over_one_connection_in_growing_batches() -> None:
    """One server: every decision of a worker goes over one connection, whatever the load; calls
    that come while a batch is on the wire ride together in the next one. (A server of its own: the
    session's has other tests' clients on it.)"""
    redis_proc = RedisProcess()
    redis_proc.start()
    key = _key()

    async def main() -> tuple[int, int]:
        runner = make_runner(RedisSettings(url=redis_proc.url, timeout=2.0))
        assert isinstance(runner, PipelineRunner)
        limiter = Limiter(runner)
        big = [rule_spec(Rule("stock", (), "quota", limit=10_000))]
        await limiter.decide(big, [key], [1])
        sizes = []
        pipeline = runner._pipeline

        async def counting(commands: Sequence[tuple[bytes | str | int, ...]]) -> list[Any]:
            sizes.append(len(commands))
            return await pipeline(commands)

        runner._pipeline = counting  # type: ignore[method-assign]

        async def client(n: int) -> None:  # a connection of a busy gateway: one request after another
            for i in range(10):
                await asyncio.sleep((n * 7 + i * 3) % 10 / 10_000)  # each at its own pace
                assert (await limiter.decide(big, [key], [1])).admitted

        await asyncio.gather(*[client(n) for n in range(100)])
        deciding = [c for c in redis_proc.client().client_list() if c["cmd"] == "evalsha"]
        await limiter.close()
        return len(deciding), max(sizes)

    try:
        connections, biggest = asyncio.run(main())
        assert connections == 1
        assert biggest > 1  # under load the calls of many ticks were batched
        assert redis_proc.client().get(key) == b"1001"
    finally:
        redis_proc.stop()


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_calls_that_wait_out_their_budget_behind_a_hung_batch_fail_and_the_runner_goes_on(
        loop_factory: str) -> None:
    """Calls queued while a batch hangs can reach their deadline before their own batch starts
    (one connection: it starts when the hung one is cut short). They fail with RedisTimeout in
    their budget like the rest, and the runner keeps serving when Redis answers again."""
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    pid = proc.process.pid

    async def main() -> None:
        runner = make_runner(RedisSettings(url=proc.url, timeout=0.05))
        limiter = Limiter(runner, breaker=Breaker(failures_to_open=1_000_000))
        assert await _served_again(limiter)  # connected, the script loaded (a busy machine may take a budget)
        os.kill(pid, signal.SIGSTOP)
        try:
            for gap, stall in ((0.001, 0.0), (0.002, 0.0), (0.01, 0.0), (0.001, 0.08), (0.01, 0.2)):
                first = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
                await asyncio.sleep(0)
                await asyncio.sleep(gap)  # the first batch is on the wire
                behind = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
                await asyncio.sleep(0)
                time.sleep(stall)  # noqa: ASYNC251 (a loop held past both deadlines: a long pause, a starved CPU)
                started = time.perf_counter()
                done = await asyncio.wait_for(asyncio.gather(first, behind, return_exceptions=True), 2.0)
                assert all(isinstance(e, RedisTimeout) for e in done), done
                assert time.perf_counter() - started < 0.5  # at their own deadlines, not the hung batch's end
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await _served_again(limiter)
        await limiter.close()

    try:
        _run_bounded(main(), loop_factory)
    finally:
        proc.stop()


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_calls_that_fail_behind_a_hung_batch_count_with_it_once_toward_the_breaker(loop_factory: str) -> None:
    """Calls whose budget ran out while they waited behind a batch Redis left unanswered were never
    sent: they fail with that batch's failure, one failure for the breaker, not two. (Counting them
    again, a stall of about two and a half budgets under load made the five failures that open the
    breaker, and the limits were off for a second.) They end that batch's turn: once Redis answers,
    the next batch has a budget of its own even if the loop is held past it before the batch starts
    (were it failed on the old batch's account, a busy loop would fail every call, uncounted, with
    Redis answering). A batch sent to a Redis that is stalled is a failure of its own."""
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    pid = proc.process.pid

    async def stalled(limiter: Limiter) -> Any:
        return (await asyncio.wait_for(asyncio.gather(limiter.decide(QUOTA, [_key()], [1]),
                                                      return_exceptions=True), 2.0))[0]

    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=0.05)), breaker=Breaker(failures_to_open=2))
        assert await _served_again(limiter)
        os.kill(pid, signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)  # the first batch is on the wire
            behind = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
            await asyncio.sleep(0)
            time.sleep(0.08)  # noqa: ASYNC251 (the loop held past both deadlines: `behind` is never sent)
            done = await asyncio.wait_for(asyncio.gather(first, behind, return_exceptions=True), 2.0)
            assert all(isinstance(e, RedisTimeout) for e in done), done
            assert done[0] is done[1]
            assert limiter.breaker_state.name == "CLOSED"
        finally:
            os.kill(pid, signal.SIGCONT)
        for _ in range(3):  # Redis answers; the loop is held past the budget before each batch starts
            call = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
            await asyncio.sleep(0)
            time.sleep(0.08)  # noqa: ASYNC251
            assert (await asyncio.wait_for(call, 2.0)).admitted
        os.kill(pid, signal.SIGSTOP)
        try:
            assert isinstance(await stalled(limiter), RedisTimeout)
            assert limiter.breaker_state.name == "CLOSED"
            assert isinstance(await stalled(limiter), RedisTimeout)  # sent, and left unanswered: counted
            assert limiter.breaker_state.name == "OPEN"
        finally:
            os.kill(pid, signal.SIGCONT)
        await limiter.close()

    try:
        _run_bounded(main(), loop_factory)
    finally:
        proc.stop()


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
@pytest.mark.parametrize("held", ["before the batch starts", "while the reply waits"])
def test_a_loop_held_past_the_budget_while_redis_answers_costs_no_timeout(
        redis_proc: RedisProcess, loop_factory: str, held: str) -> None:
    """The loop stalls (a saturated worker, a starved CPU) past a call's budget, either between the
    call being queued and its batch's first step, or after the batch was sent while Redis's reply
    sits in the socket. uvloop then runs the due timer before that step or before it polls the
    socket. Redis answered in time: the call is served, not failed (issue 27: counting the loop's
    time failed every decision of a saturated worker and the breaker never closed)."""
    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=redis_proc.url, timeout=0.05)),
                          breaker=Breaker(failures_to_open=1_000_000))
        assert await _served_again(limiter)
        for _ in range(3):
            call = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
            await asyncio.sleep(0)  # the call is queued and its batch's task created ...
            if held == "while the reply waits":
                await asyncio.sleep(0)  # ... the batch's first step writes the call ...
                await asyncio.sleep(0)
            time.sleep(0.1)  # noqa: ASYNC251 (... and the loop is held past the call's deadline)
            assert (await asyncio.wait_for(call, 2.0)).admitted
        await limiter.close()

    _run_bounded(main(), loop_factory)


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_batch_gets_its_whole_budget_from_when_it_is_sent(loop_factory: str) -> None:
    """The loop holds a call for most of its budget before its batch's first step (a saturated
    worker), then Redis takes a little while to answer, well within one budget of the send. The
    call is served: the time queued was the worker's, not Redis's. (Counting it, a batch sent with
    2 ms of a 20 ms budget left failed when Redis took 3; one such batch opened the breaker of a
    saturated worker while Redis was healthy.)"""
    budget = within(0.2)
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    pid = proc.process.pid

    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=budget)),
                          breaker=Breaker(failures_to_open=1_000_000))
        await limiter.decide(QUOTA, [_key()], [1])
        for _ in range(2):
            os.kill(pid, signal.SIGSTOP)
            resumed = threading.Timer(budget * 1.3, os.kill, (pid, signal.SIGCONT))
            resumed.start()
            try:
                call = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
                await asyncio.sleep(0)  # the call is queued and its batch's task created ...
                time.sleep(budget * 0.9)  # noqa: ASYNC251 (... and the loop held for most of its budget)
                assert (await asyncio.wait_for(call, 10 * budget)).admitted
            finally:
                resumed.join()
        await limiter.close()

    try:
        _run_bounded(main(), loop_factory)
    finally:
        proc.stop()


def test_one_batch_redis_answers_late_fails_its_calls_and_counts_once_toward_the_breaker() -> None:
    """A Redis stall just over the budget (a fork, a slow command) while 50 decisions ride in one
    batch: the 50 fail, as their budget says, but that is one failed round trip, not 50, and the
    breaker stays closed. (Counting each call, one late batch opened it: the limits off for a
    second under any load.) Five failed round trips in a row still open it."""
    budget = within(0.05)
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    pid = proc.process.pid

    async def stalled_round(limiter: Limiter, calls: int) -> list[Any]:
        os.kill(pid, signal.SIGSTOP)
        resumed = threading.Timer(budget * 3, os.kill, (pid, signal.SIGCONT))
        resumed.start()
        try:
            return await asyncio.gather(*[limiter.decide(QUOTA, [_key()], [1]) for _ in range(calls)],
                                        return_exceptions=True)
        finally:
            resumed.join()

    async def main() -> None:
        limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=budget)))
        await _healthy_decision(limiter)
        failed = await stalled_round(limiter, 50)
        assert all(isinstance(e, RedisTimeout) for e in failed), failed
        assert limiter.breaker_state.name == "CLOSED"
        assert (await _healthy_decision(limiter)).admitted
        for _ in range(limiter.breaker.failures_to_open):
            assert limiter.breaker_state.name == "CLOSED"
            failed = await stalled_round(limiter, 10)
            assert all(isinstance(e, RedisTimeout) for e in failed), failed
        assert limiter.breaker_state.name == "OPEN"
        with pytest.raises(BreakerOpen):
            await limiter.decide(QUOTA, [_key()], [1])
        await limiter.close()

    try:
        asyncio.run(main())
    finally:
        proc.stop()


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_loop_held_while_redis_does_not_answer_still_times_out(loop_factory: str) -> None:
    """The other side of the test above: Redis stopped (SIGSTOP) and the loop held past the budget:
    no reply waits in the socket, so the call fails with RedisTimeout, and calls queued behind the
    batch that timed out fail without being sent."""
    proc = RedisProcess()
    proc.start()
    assert proc.process is not None
    try:
        async def main() -> None:
            limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=0.05)),
                              breaker=Breaker(failures_to_open=1_000_000))
            assert await _served_again(limiter)
            os.kill(proc.process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                first = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
                await asyncio.sleep(0.01)
                behind = asyncio.ensure_future(limiter.decide(QUOTA, [_key()], [1]))
                time.sleep(0.1)  # noqa: ASYNC251
                started = time.perf_counter()
                for call in (first, behind):
                    with pytest.raises(RedisTimeout):
                        await asyncio.wait_for(call, 2.0)
                assert time.perf_counter() - started < 0.05 + 0.25
            finally:
                os.kill(proc.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
            assert await _served_again(limiter)
            await limiter.close()

        _run_bounded(main(), loop_factory)
    finally:
        proc.stop()


def test_the_probe_closes_the_breaker_with_the_scripts_loaded_and_no_request_waiting() -> None:
    """Redis restarted with empty memory while the breaker is open: no request asks it, the probe
    does, off the request path; when the breaker closes the decision script is already loaded and
    the connection made, so the first decision after it is one round trip."""
    proc = RedisProcess()
    proc.start()
    try:
        async def main() -> None:
            opened: list[str] = []
            seconds: list[float] = []
            limiter = Limiter(make_runner(RedisSettings(url=proc.url, timeout=0.05)),
                              on_breaker=lambda state: opened.append(state.name), on_open_time=seconds.append)
            assert await _served_again(limiter)
            sha = next(iter(limiter.scripts.values())).script.sha
            assert proc.process is not None
            proc.process.kill()
            proc.process.wait()
            for _ in range(limiter.breaker.failures_to_open):
                with pytest.raises(RedisUnavailable):
                    await limiter.decide(QUOTA, [_key()], [1])
            assert limiter.breaker_state.name == "OPEN"
            with pytest.raises(BreakerOpen):
                await limiter.decide(QUOTA, [_key()], [1])
            if proc.process.stderr:
                proc.process.stderr.close()
            proc.process = None
            proc.start()
            assert proc.client().script_exists(sha.decode()) == [False]
            for _ in range(100):  # the probe runs every open_for (1 s)
                if limiter.breaker_state.name == "CLOSED":
                    break
                await asyncio.sleep(0.05)
            assert limiter.breaker_state.name == "CLOSED"
            assert proc.client().script_exists(sha.decode()) == [True]  # loaded by the probe, no request asked
            assert opened[0] == "OPEN" and "HALF_OPEN" in opened and opened[-1] == "CLOSED"
            assert sum(seconds) >= limiter.breaker.open_for
            assert (await limiter.decide(QUOTA, [_key()], [1])).admitted
            await limiter.close()

        _run_bounded(main(), "asyncio")
    finally:
        proc.stop()


async def _served_again(limiter: Limiter) -> bool:
    """The runner serves again: a call admitted. Its budget is 50 ms, which a busy machine can
    spend reconnecting, so a call that times out is followed by another; a wedged runner answers
    none of them (asyncio's TimeoutError, not RedisTimeout)."""
    for _ in range(20):
        try:
            return (await asyncio.wait_for(limiter.decide(QUOTA, [_key()], [1]), 2.0)).admitted
        except RedisTimeout:
            continue
        except BreakerOpen:  # a timeout too many: the breaker's probe closes it again
            await asyncio.sleep(0.1)
    return False


def _run_bounded(main: Coroutine[Any, Any, None], loop_factory: str) -> None:
    """Run `main` on the loop named, failing (not hanging) if the runner wedges."""
    async def bounded() -> None:
        await asyncio.wait_for(main, 20.0)

    if loop_factory == "uvloop":
        import uvloop

        uvloop.run(bounded())
    else:
        asyncio.run(bounded())
