"""A logging upstream for the conformance suite: a raw TCP server that records, byte for byte,
every request the gateway sends it, and answers either a plain 200 or, for `/script/<name>`, the
exact bytes a test put under that name (to play a hostile or broken upstream), and then, if the
test said so, more bytes a moment later (then it closes the connection).

It runs on its own event loop in a thread of the test process, so a test reads what was received
directly. Requests are split by their own framing (Content-Length or chunked), the way a strict
origin server would read them; whatever else arrives is logged as it came.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


@dataclass
class Received:
    connection: int
    head: bytes          # request line and headers, through the blank line
    body: bytes          # the body as it came on the wire (chunk framing included)

    @property
    def raw(self) -> bytes:
        return self.head + self.body

    @property
    def target(self) -> bytes:
        return self.head.split(b" ", 2)[1]


@dataclass
class LoggingUpstream:
    # kept out of the repr: hypothesis prints every argument of a test, fixtures included, and the
    # log of a whole session is hundreds of kilobytes (a HypothesisWarning, an error under -Werror)
    received: list[Received] = field(default_factory=list, repr=False)
    scripts: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    # bytes a script writes after its answer, and after how many seconds (a late body, a stray response)
    late: dict[bytes, tuple[float, bytes]] = field(default_factory=dict, repr=False)
    sent_late: set[bytes] = field(default_factory=set, repr=False)  # the scripts whose late bytes are out
    connections: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._lock = threading.Lock()
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(5)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        server = self._server
        if server is not None:
            self._loop.call_soon_threadsafe(server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """What hypothesis prints for this fixture: it reads a dataclass's fields, not its repr."""
        printer.text(f"LoggingUpstream(port={self.port}, received={len(self.received)} requests)")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def mark(self) -> int:
        with self._lock:
            return len(self.received)

    def since(self, mark: int) -> list[Received]:
        with self._lock:
            return list(self.received[mark:])

    def quiet(self, for_seconds: float = 0.3, longest: float = 5.0) -> None:
        """Wait until no request has arrived for `for_seconds`. After a case a weaker protocol
        failed: it may have answered the client while a request of that case was still being
        forwarded, which would otherwise land in the next case's window."""
        deadline = time.monotonic() + longest
        seen = self.mark()
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.mark()
            if now != seen:
                seen, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since >= for_seconds:
                return

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    body = await _read_body(reader, head)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return  # the gateway gave up on this request (a refused client): nothing was received
                with self._lock:
                    self.received.append(Received(number, head, body))
                target = head.split(b" ", 2)[1]
                name = target.split(b"?")[0].rsplit(b"/", 1)[-1] if b"/script/" in target else b""
                writer.write(self.scripts.get(name, OK))
                await writer.drain()
                if name in self.late:
                    delay, data = self.late[name]
                    await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
                    self.sent_late.add(name)
                    return  # and closes: what it sent late is all a next request could ever get
        except ConnectionError:
            return
        finally:
            writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        out = b""
        while True:
            line = await reader.readuntil(b"\r\n")
            out += line
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    out += trailer
                return out + b"\r\n"
            out += await reader.readexactly(size + 2)
    length = int(fields.get(b"content-length", b"0") or 0)
    return await reader.readexactly(length) if length else b""
