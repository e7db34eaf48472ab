"""An OpenAI-compatible upstream of the tests' own, on raw asyncio streams, so that a test decides
every TCP write: any POST answers JSON, or Server-Sent Events (chunked) when the request streams.

It reads its request as a pydantic-based OpenAI-compatible server does (vLLM's fields, pydantic's
lax mode: `"9000"`, `9000.0` and `9e3` are 9000), answers 422 to a request pydantic refuses, and,
as OpenAI does, ends a stream with a usage chunk only when `stream_options.include_usage` is true.
The request's JSON also says what the answer does:

    "used": N            the total the answer reports (absent: none)
    "prompt_used": N     the prompt's tokens in it (default 1)
    "fill": true         the answer generates as many tokens as the request allows (vLLM: the first
                         of max_completion_tokens, max_tokens, times n or best_of and the number of
                         prompts of a legacy completion) and reports them
    "tag": NAME          count what answers generate under NAME (`generated[NAME]`)
    "duplicate": SHAPE   the JSON answer repeats a usage field, the smaller last ("usage" or "field")
    "style": "openai"    OpenAI's chunks and final usage chunk (stream_options.include_usage), or
             "anthropic" Anthropic's message_start / content_block_delta / message_delta events
    "events": N          content events before the usage (default 3)
    "split": true        every event written one byte at a time
    "pad": N             the usage event carries N bytes of padding (larger than one read)
    "cut": true          the stream stops in the middle of the usage event, the connection closed
    "hold": NAME         after the first event, wait until the test sets the event NAME
    "status": N          the answer's status (JSON answers)

It records when it wrote each answer's last byte (`finished[request id]`), the requests it read
(`received`: their Content-Length and parsed body) and its answers (`answered`).

`embedded_app` is the same upstream as an ASGI app behind `gateway.RateLimitMiddleware` (config and
Redis from LLM_EMBED_CONFIG and LLM_EMBED_REDIS_URL): it answers what it received, for the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.types import Receive, Scope, Send


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class Asked(BaseModel):
    """What a pydantic-based server reads of a request (lax mode), extra fields allowed."""

    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None

    @property
    def bound(self) -> int:
        return self.max_output_tokens or self.max_completion_tokens or self.max_tokens or 16

    @property
    def generated(self) -> int:
        prompts = len(self.prompt) if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int) else 1
        return self.bound * max(self.n, self.best_of or 1) * prompts

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def read(body: bytes) -> Asked | None:
    """The request as the server reads it; None: it answers 422."""
    try:
        return Asked.model_validate(json.loads(body) if body else {})
    except (ValueError, ValidationError):
        return None


def usage_of(asked: Asked) -> dict[str, int] | None:
    extra = asked.model_extra or {}
    prompt = int(extra.get("prompt_used", 1))
    if extra.get("fill"):
        return {"prompt_tokens": prompt, "completion_tokens": asked.generated, "total_tokens": prompt + asked.generated}
    if "used" in extra:
        used = int(extra["used"])
        return {"prompt_tokens": prompt, "completion_tokens": used - prompt, "total_tokens": used}
    return None


class LlmUpstream:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0
        self.holds: dict[str, threading.Event] = {}
        self.finished: dict[str, float] = {}
        self.requests = 0
        self.received: list[tuple[int, Any]] = []  # (Content-Length, the body as JSON) of each request
        self.generated: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close_server() -> None:
            self.server.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(close_server(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def hold(self, name: str) -> threading.Event:
        event = self.holds[name] = threading.Event()
        return event

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                request_id = ""
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                    if name.strip().lower() == b"x-request-id":
                        request_id = value.strip().decode()
                body = await reader.readexactly(length) if length else b""
                self.requests += 1
                try:
                    self.received.append((length, json.loads(body) if body else None))
                except ValueError:
                    self.received.append((length, "not JSON"))
                model = read(body)
                if model is None:
                    await self._refuse(writer)
                    continue
                asked = model.model_extra or {}
                usage = usage_of(model)
                if usage is not None:
                    self.generated[str(asked.get("tag"))] += usage["completion_tokens"]
                if model.stream:
                    if not await self._stream(writer, asked, usage if model.include_usage else None):
                        return
                else:
                    await self._json(writer, asked, usage)
                self.finished[str(asked.get("hold") or request_id)] = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _refuse(self, writer: asyncio.StreamWriter) -> None:
        data = b'{"detail": "validation error"}'
        writer.write(b"HTTP/1.1 422 X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % len(data) + data)
        await writer.drain()

    async def _json(self, writer: asyncio.StreamWriter, asked: dict[str, Any], usage: dict[str, int] | None) -> None:
        answer: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
        if usage is not None:
            answer["usage"] = usage
        data = json.dumps(answer).encode()
        if usage is not None and asked.get("duplicate"):
            data = _duplicated(data, usage, asked["duplicate"])
        status = int(asked.get("status", 200))
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % (status, len(data)) + data)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, asked: dict[str, Any], usage: dict[str, int] | None) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = _events(asked, usage)
        for n, event in enumerate(events):
            if asked.get("cut") and n == len(events) - 2:  # the usage event
                half = event[: len(event) // 2]
                writer.write(b"%x\r\n" % len(event) + half)  # the chunk promised whole, sent half
                await writer.drain()
                return False
            if asked.get("split"):
                writer.write(b"%x\r\n" % len(event))
                for i in range(len(event)):
                    writer.write(event[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"\r\n")
            else:
                writer.write(b"%x\r\n" % len(event) + event + b"\r\n")
            await writer.drain()
            hold = asked.get("hold")
            if n == 0 and hold:
                released = self.holds[hold]
                await self.loop.run_in_executor(None, released.wait, 10)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _duplicated(data: bytes, usage: dict[str, int], shape: str) -> bytes:
    """The answer with a usage field repeated: a smaller value after the real one."""
    small = {name: 1 for name in usage}
    if shape == "usage":
        return data[:-1] + b', "usage": ' + json.dumps(small).encode() + b"}"
    fields = b", ".join(b'"%s": %d, "%s": 1' % (name.encode(), value, name.encode()) for name, value in usage.items())
    return data.replace(json.dumps(usage).encode(), b"{" + fields + b"}")


def _events(asked: dict[str, Any], usage: dict[str, int] | None) -> list[bytes]:
    count = int(asked.get("events", 3))
    pad = "p" * int(asked.get("pad", 0))
    used = asked.get("used")
    if asked.get("style") == "anthropic":
        out = [("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 7,
                                                                                 "output_tokens": 1}}})]
        out += [("content_block_delta", {"type": "content_block_delta", "delta": {"text": f"t{n}"}})
                for n in range(count)]
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "pad": pad}
        if used is not None:
            delta["usage"] = {"output_tokens": used}
        out.append(("message_delta", delta))
        out.append(("message_stop", {"type": "message_stop"}))
        return [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in out]
    chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"content": f"t{n}"}}], "usage": None}
                                    for n in range(count)]
    if usage is None:  # OpenAI: no usage chunk unless stream_options.include_usage
        return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
    final: dict[str, Any] = {"choices": [], "pad": pad, "usage": usage}
    chunks.append(final)
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


async def _asgi_completion(scope: Scope, receive: Receive, send: Send) -> None:
    """One request to `embedded_app`: its body read whole, answered as the raw upstream answers,
    with what the app received (the body's length, its Content-Length) in the first event or the JSON."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    lengths = [value.decode() for name, value in scope["headers"] if name == b"content-length"]
    received = {"length": len(body), "content_length": lengths, "body": json.loads(body) if body else None}
    model = read(body)
    if model is None:
        await _send_whole(send, 422, b"application/json", b'{"detail": "validation error"}')
        return
    usage = usage_of(model)
    if not model.stream:
        await _send_whole(send, 200, b"application/json", json.dumps({"received": received, "usage": usage}).encode())
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in [b"data: " + json.dumps({"received": received, "usage": None}).encode() + b"\n\n",
                  *_events(model.model_extra or {}, usage if model.include_usage else None)]:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send: Send, status: int, media: bytes, data: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", media), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _asgi(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await _asgi_completion(scope, receive, send)


def _embedded() -> Any:
    from gateway import RateLimitMiddleware

    return RateLimitMiddleware(_asgi, config=os.environ.get("LLM_EMBED_CONFIG", "routes.yaml"),
                               redis_url=os.environ.get("LLM_EMBED_REDIS_URL") or None)


def __getattr__(name: str) -> Any:
    if name == "embedded_app":  # built when uvicorn asks for it, not when the tests import the module
        return _embedded()
    raise AttributeError(name)
