"""The server protocol (gateway/http/server.py) keeps ASGI's promise about `receive()` once a
request's body has been read whole: the next message is `http.disconnect`, when the client goes or
the answer ends, never another empty body at once. Starlette's StreamingResponse and FileResponse
listen for the client's going while they send; answered at once, that loop never yielded, and the
worker spun at full CPU with the answer unsent (the admin console met it). A real uvicorn server on
the gateway's protocol, in this process, and a real client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.http.server import ServerConfig, ServerOptions
from tests.support.ports import free_port
from tests.support.waiting import wait_for_port


async def _chunks() -> AsyncIterator[bytes]:
    for piece in (b"first ", b"second"):
        await asyncio.sleep(0)
        yield piece


async def streamed(request: Request) -> StreamingResponse:
    await request.body()  # read whole: what the app receives next is the client's going
    return StreamingResponse(_chunks())


async def messages_after_the_body(scope: Scope, receive: Receive, send: Send) -> None:
    seen = [await receive()]
    while seen[-1].get("more_body"):
        seen.append(await receive())
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
    after = await receive()  # the answer has ended: this returns, as the client's going
    assert after["type"] == "http.disconnect", after


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    starlette = Starlette(routes=[Route("/stream", streamed, methods=["GET", "POST"])])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("path") == "/boom":
            raise RuntimeError("the handler failed")
        handler = messages_after_the_body if scope.get("path") == "/raw" else starlette
        await handler(scope, receive, send)

    chosen = free_port()
    config = ServerConfig(app, ServerOptions(), host="127.0.0.1", port=chosen, loop="asyncio", lifespan="off",
                          log_config=None, ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port(chosen)
    yield chosen
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("body", [b"", b"x" * 100_000])
def test_a_streaming_response_that_listens_for_the_client_going_is_sent_whole(port: int, body: bytes) -> None:
    answer = httpx.post(f"http://127.0.0.1:{port}/stream", content=body, timeout=5)
    assert answer.status_code == 200 and answer.content == b"first second"


def test_receive_after_the_whole_body_and_the_answer_is_the_clients_going(port: int) -> None:
    answer = httpx.post(f"http://127.0.0.1:{port}/raw", content=b"abc", timeout=5)
    assert answer.status_code == 200 and answer.content == b"ok"


def test_a_handler_that_fails_is_answered_500_at_once(port: int) -> None:
    """Before, the 500 waited for the request in service to end: the one that had failed, so it never
    came, and the client waited on an open connection (an upstream URL of port 99999 did it)."""
    answer = httpx.get(f"http://127.0.0.1:{port}/boom", timeout=5)
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["connection"] == "close"
