"""An OpenAI-compatible upstream of the tests' own, on raw asyncio streams, so that a test decides
every TCP write: `POST /v1/chat/completions` answers JSON, or Server-Sent Events (chunked) when the
request says `"stream": true`. The request's JSON also says what the answer does:

    "used": N            the usage the answer reports (absent: none)
    "style": "openai"    OpenAI's chunks and final usage chunk (stream_options.include_usage), or
             "anthropic" Anthropic's message_start / content_block_delta / message_delta events
    "events": N          content events before the usage (default 3)
    "split": true        every event written one byte at a time
    "pad": N             the usage event carries N bytes of padding (larger than one read)
    "cut": true          the stream stops in the middle of the usage event, the connection closed
    "hold": NAME         after the first event, wait until the test sets the event NAME
    "status": N          the answer's status (JSON answers)

It records when it wrote each answer's last byte (`finished[request id]`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any


class LlmUpstream:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0
        self.holds: dict[str, threading.Event] = {}
        self.finished: dict[str, float] = {}
        self.requests = 0

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
                    asked: dict[str, Any] = json.loads(body) if body else {}
                except ValueError:
                    asked = {}
                if not isinstance(asked, dict):
                    asked = {}
                if asked.get("stream"):
                    if not await self._stream(writer, asked):
                        return
                else:
                    await self._json(writer, asked)
                self.finished[str(asked.get("hold") or request_id)] = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, asked: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
        if "used" in asked:
            answer["usage"] = {"prompt_tokens": 1, "completion_tokens": asked["used"] - 1,
                               "total_tokens": asked["used"]}
        data = json.dumps(answer).encode()
        status = int(asked.get("status", 200))
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % (status, len(data)) + data)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, asked: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = _events(asked)
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


def _events(asked: dict[str, Any]) -> list[bytes]:
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
    final: dict[str, Any] = {"choices": [], "pad": pad}
    if used is not None:
        final["usage"] = {"prompt_tokens": 1, "completion_tokens": used - 1, "total_tokens": used}
    chunks.append(final)
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
