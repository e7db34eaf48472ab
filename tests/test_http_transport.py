"""Forwarding (gateway.proxy.UpstreamClient) through each upstream transport the gateway ships —
the lean one (gateway/http/transport.py) and httpx's AsyncHTTPTransport — against real servers,
including ones that misbehave on purpose: closed keep-alive connections, bodies delimited by the
end of the connection, 1xx answers, HEAD, stalls, truncation and a bounded pool. Every test runs
against both: the lean transport is allowed only because it passes what httpx's passes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest
import uvloop

from gateway.config import Upstream
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.http.request import Request
from gateway.http.transport import LeanTransport
from gateway.proxy import TRANSPORTS, ClientTooSlow, RequestBody, UpstreamClient
from tests.support.upstream import Upstream as AiohttpUpstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """A TCP server whose handler writes whatever bytes a test needs; counts its connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open_now -= 1
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The request head (bodies are not sent to these servers)."""
    return await reader.readuntil(b"\r\n\r\n")


class Collected:
    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.finished = False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = message["headers"]
        else:
            self.body += message.get("body", b"")
            self.finished = not message.get("more_body", False)


async def forward(pool: UpstreamClient, method: bytes = b"GET", target: bytes = b"/",
                  headers: list[tuple[bytes, bytes]] | None = None,
                  body: RequestBody | None = None) -> tuple[int, Collected]:
    """Forward one request; the status is negated when the response broke off after it began."""
    out = Collected()
    path, _, query = target.partition(b"?")
    headers = headers or []
    lengths = [int(v) for k, v in headers if k == b"content-length"]
    request = Request(
        method=method.decode(), path=path.decode(), raw_path=path, query=query, peer="127.0.0.1",
        scheme="http", host=b"gw", forwarded_for=None, content_length=lengths[0] if lengths else None,
        chunked=body is not None and not lengths, headers=[(k, v) for k, v in headers if k != b"content-length"],
        first=dict(headers), repeated=frozenset(),
    )
    forwarded = await pool.forward(request, body, out, [(b"x-extra", b"1")], b"rid")
    return (-forwarded.status if forwarded.aborted else forwarded.status), out


def pool_for(transport: str, url: str, **kw: Any) -> UpstreamClient:
    return UpstreamClient(Upstream("u", url, **kw), transport)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(coro: Any) -> Any:
    return uvloop.run(coro)


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-up: yes\r\n\r\nok"


def test_keep_alive_reuses_one_connection_and_passes_status_headers_body(transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            for _ in range(20):
                status, out = await forward(pool)
                assert (status, out.body, out.finished) == (200, b"ok", True)
                assert (b"x-up", b"yes") in out.headers and (b"x-extra", b"1") in out.headers
            assert server.connections == 1
            await pool.close()

    run(go())


def test_a_body_still_arriving_is_passed_on_as_it_comes_and_a_whole_one_in_one_message(transport: str) -> None:
    """A response that came whole with its head goes to the client as one body message; one whose
    body is still arriving is streamed: its first part reaches the client before the rest exists."""
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
        await writer.drain()
        await release.wait()
        writer.write(b"-last")
        await read_request(reader)
        writer.write(OK)

    class Watching(Collected):
        def __init__(self) -> None:
            super().__init__()
            self.bodies: list[tuple[bytes, bool]] = []

        async def __call__(self, message: MutableMapping[str, Any]) -> None:
            await super().__call__(message)
            if message["type"] == "http.response.body":
                self.bodies.append((message.get("body", b""), message.get("more_body", False)))
                release.set()  # the upstream sends the rest only once the first part is through

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            streamed = Watching()
            request = Request(method="GET", path="/", raw_path=b"/", query=b"", peer="127.0.0.1", scheme="http",
                              host=b"gw", forwarded_for=None, content_length=None, chunked=False, headers=[],
                              first={}, repeated=frozenset())
            forwarded = await asyncio.wait_for(pool.forward(request, None, streamed, [], b"rid"), 5)
            assert forwarded.status == 200 and not forwarded.aborted
            assert streamed.bodies[0] == (b"first", True) and streamed.body == b"first-last" and streamed.finished
            whole = Watching()
            await pool.forward(request, None, whole, [], b"rid")
            if transport == "lean":
                assert whole.bodies == [(b"ok", False)]
            assert whole.body == b"ok" and whole.finished and server.connections == 1
            await pool.close()

    run(go())


# httpcore cannot tell a kept-alive connection the upstream closed from a broken answer (both are a
# RemoteProtocolError), so httpx's transport does not retry: this one is the lean transport's own.
@pytest.mark.parametrize("transport", ["lean"])
def test_a_kept_alive_connection_closed_by_the_upstream_is_retried_once_for_a_get_only(transport: str) -> None:
    # Each connection answers one request, then closes when the next one arrives: the race an
    # upstream's keep-alive timeout causes.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            for _ in range(3):
                status, out = await forward(pool)
                assert (status, out.body) == (200, b"ok")
            assert server.connections == 3
            body = RequestBody(b"payload", False, _no_more)
            with pytest.raises(UpstreamUnavailable):  # a POST is never sent twice
                await forward(pool, b"POST", b"/", [(b"content-length", b"7")], body)
            await pool.close()

    run(go())


async def _no_more() -> dict[str, Any]:
    raise AssertionError("the body was complete")


def test_a_body_delimited_by_the_end_of_the_connection_arrives_whole(transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
        for piece in (b"a" * 1000, b"b" * 1000, b"c"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            status, out = await forward(pool)
            assert (status, out.body, out.finished) == (200, b"a" * 1000 + b"b" * 1000 + b"c", True)
            assert all(name != b"connection" for name, _ in out.headers)  # hop-by-hop
            status, out = await forward(pool)
            assert status == 200 and server.connections == 2
            await pool.close()

    run(go())


def test_informational_answers_are_skipped_and_head_reuses_the_connection_when_it_announces_no_body(
        transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            head = await read_request(reader)
            if head.startswith(b"HEAD /empty"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            elif head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")  # and no body
            else:
                writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + OK)

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            status, out = await forward(pool, b"HEAD", b"/empty")
            assert (status, out.body, out.finished) == (200, b"", True)
            status, out = await forward(pool)
            assert (status, out.body) == (200, b"ok")
            assert all(name != b"link" for name, _ in out.headers)
            assert server.connections == 1
            status, out = await forward(pool, b"HEAD")
            assert (status, out.body, out.finished) == (200, b"", True)
            assert (b"content-length", b"1000") in out.headers
            status, out = await forward(pool)
            assert (status, out.body) == (200, b"ok")
            # a body announced and never sent by its framing may still come, late: that connection
            # is closed (httpx's reuses it; tests/conformance shows what the next request then reads)
            assert server.connections == (2 if transport == "lean" else 1)
            await pool.close()

    run(go())


def test_stalls_truncation_and_garbage_map_to_timeout_abort_and_unavailable(transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        head = await read_request(reader)
        if b"/silent" in head:
            await asyncio.sleep(5)
        elif b"/stall" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            await asyncio.sleep(5)
        elif b"/short" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        else:
            writer.write(b"SMTP ready\r\n\r\n")

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url, timeout=0.3)
            with pytest.raises(UpstreamTimeout):
                await forward(pool, target=b"/silent")
            status, out = await forward(pool, target=b"/stall")
            assert status == -200 and not out.finished  # begun, then broken off: never looks complete
            status, out = await forward(pool, target=b"/short")
            assert status == -200 and not out.finished
            with pytest.raises(UpstreamUnavailable):
                await forward(pool, target=b"/garbage")
            if isinstance(pool.transport, LeanTransport):  # every broken connection let go
                assert pool.transport.pool is not None and pool.transport.pool.open == 0
            await pool.close()

    run(go())


def test_connections_never_exceed_max_connections_and_everyone_is_served(transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(0.02)
            writer.write(OK)

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url, max_connections=2)
            results = await asyncio.gather(*(forward(pool) for _ in range(12)))
            assert [status for status, _ in results] == [200] * 12
            assert server.most_open == 2
            await pool.close()

    run(go())


def test_an_unreachable_upstream_is_unavailable(transport: str) -> None:
    async def go() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamUnavailable):
            await forward(pool_for(transport, f"http://127.0.0.1:{port}"))

    run(go())


@pytest.fixture(scope="module")
def aiohttp_upstream() -> Any:
    upstream = AiohttpUpstream()
    upstream.start()
    yield upstream
    upstream.stop()


def test_a_body_of_unknown_length_is_sent_chunked_and_arrives_exact(transport: str, aiohttp_upstream: Any) -> None:
    pieces = [bytes([i]) * (1000 * i + 1) for i in range(1, 30)]
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces[1:]]
    messages[-1]["more_body"] = False
    queue = iter(messages)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)
        return next(queue)

    async def go() -> None:
        pool = pool_for(transport, aiohttp_upstream.url)
        status, out = await forward(pool, b"POST", b"/upload", [], RequestBody(pieces[0], True, receive))
        assert status == 200
        answer = json.loads(out.body)
        whole = b"".join(pieces)
        assert answer == {"length": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
        await pool.close()
        prefixed = pool_for(transport, aiohttp_upstream.url + "/echo/")  # a base path is kept in front
        status, out = await forward(prefixed, b"GET", b"/a%2Fb?x=1", [(b"x-a", b"b")])
        echoed = json.loads(out.body)
        assert echoed["raw_path"] == "/echo/a%2Fb?x=1" and echoed["query"] == "x=1"
        assert ["Host", aiohttp_upstream.url.removeprefix("http://")] in echoed["headers"]
        assert ["X-A", "b"] in echoed["headers"] or ["x-a", "b"] in echoed["headers"]
        await prefixed.close()

    run(go())



def test_a_body_below_the_minimum_rate_is_too_slow_whatever_its_pauses(transport: str, aiohttp_upstream: Any) -> None:
    """Each pause is far shorter than the body timeout, yet the body as a whole comes slower than
    `min_rate` once the grace period is spent: the client is too slow (408), and the upstream
    connection it held is free again. The same body sent without pauses arrives whole."""
    head = b"a" * 20_000  # more than is read before the upstream connection is taken

    def trickle(pause: float) -> Callable[[], Awaitable[dict[str, Any]]]:
        pieces = iter([b"b" * 10] * 200)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(pause)
            piece = next(pieces, None)
            return {"type": "http.request", "body": piece or b"", "more_body": piece is not None}
        return receive

    async def go() -> None:
        pool = pool_for(transport, aiohttp_upstream.url, max_connections=1)
        slow = RequestBody(head, True, trickle(0.05), min_rate=1_000_000, grace=0.2)
        with pytest.raises(ClientTooSlow):
            await forward(pool, b"POST", b"/upload", [], slow)
        fast = RequestBody(head, True, trickle(0), min_rate=1_000_000, grace=0.2)
        status, out = await forward(pool, b"POST", b"/upload", [], fast)
        assert status == 200 and json.loads(out.body)["length"] == len(head) + 2000
        await pool.close()

    run(go())


def test_the_upstreams_time_ends_with_the_answers_head_not_the_clients_reading(transport: str) -> None:
    """What a protected upstream's limit learns from (Forwarded.head): three slow readers of a large
    file once made a 50 ms upstream look 1.8 s slow, and honest requests were shed."""
    body = b"x" * (1 << 20)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    class SlowReader(Collected):
        """A client taking each part of the body a while after the last."""

        paced = 0.0

        async def __call__(self, message: MutableMapping[str, Any]) -> None:
            await super().__call__(message)
            if message["type"] == "http.response.body" and message.get("more_body"):
                await asyncio.sleep(0.05)
                self.paced += 0.05

    async def go() -> None:
        async with RawServer(handler) as server:
            pool = pool_for(transport, server.url)
            out = SlowReader()
            request = Request(method="GET", path="/big", raw_path=b"/big", query=b"", peer="127.0.0.1",
                              scheme="http", host=b"gw", forwarded_for=None, content_length=None, chunked=False,
                              headers=[], first={}, repeated=frozenset())
            forwarded = await pool.forward(request, None, out, [], b"rid")
            assert out.body == body and out.paced >= 0.2, out.paced  # the client took its time
            assert forwarded.head < out.paced, (forwarded.head, out.paced)
            await pool.close()

    run(go())
