"""uvicorn's httptools protocol with the bounds a proxy facing the internet needs.

- the request line and headers together may not exceed `MAX_HEADER_BYTES` (431), the URL alone
  `MAX_URL_BYTES` (414); nothing past the bound is buffered;
- a client must finish sending its headers within `HEADER_TIMEOUT` seconds of starting (408):
  slow-header (slowloris) connections are closed instead of held open;
- malformed requests, including conflicting Content-Length / Transfer-Encoding, are refused by the
  parser (400) and never forwarded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 * 1024
MAX_URL_BYTES = 8 * 1024
HEADER_TIMEOUT = 10.0


def _problem_bytes(status: int, title: str, detail: str) -> bytes:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {title}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


class _CoalescingTransport:
    """Writes made in one event-loop step leave in one `write()`: the response head and a small
    body become one syscall (and one packet) instead of two. Everything else is the transport's."""

    __slots__ = ("_buffer", "_loop", "_scheduled", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._buffer: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes) -> None:
        self._buffer.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._buffer))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True
        self._header_bytes = 0
        self._url_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._head_started = 0.0
        self._awaiting_head = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _CoalescingTransport(transport, self.loop)  # type: ignore[assignment]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._awaiting_head = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    # The timer is armed at most once per HEADER_TIMEOUT, not once per request: when it fires it
    # checks how long the current head has been arriving and sleeps again for the rest.
    def _arm_header_timer(self) -> None:
        self._head_started = self.loop.time()
        self._awaiting_head = True
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        self._awaiting_head = False

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        waited = self.loop.time() - self._head_started
        if waited < HEADER_TIMEOUT:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT - waited, self._header_timeout)
        elif self._in_headers and self._header_bytes:
            self._refuse(408, "Request Timeout", f"request headers not received within {HEADER_TIMEOUT:.0f}s")
        elif self._in_headers and self.cycle is None:
            self.transport.close()  # connected and silent: nothing to answer

    def _refuse(self, status: int, title: str, detail: str) -> None:
        self.logger.info("refused a request: %s", detail)
        self.transport.write(_problem_bytes(status, title, detail))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        # One read may carry the head and the start of a large body: judge the head only if it is
        # still incomplete after this read (what is buffered stays below the bound plus one read).
        counting = self._in_headers
        if counting:
            self._header_bytes += len(data)
        super().data_received(data)
        if (counting and self._in_headers and self._header_bytes > MAX_HEADER_BYTES + MAX_URL_BYTES
                and not self.transport.is_closing()):
            self._refuse(431, "Request Header Fields Too Large",
                         f"request line and headers exceed {MAX_HEADER_BYTES // 1024} KiB")

    def _too_large(self, status: int) -> None:
        if status == 414:
            self._refuse(414, "URI Too Long", f"the URL exceeds {MAX_URL_BYTES // 1024} KiB")
        else:
            self._refuse(431, "Request Header Fields Too Large",
                         f"request headers exceed {MAX_HEADER_BYTES // 1024} KiB")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._url_bytes = 0
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > MAX_URL_BYTES:
            self._too_large(414)
            raise httptools.HttpParserError("URL too long")
        super().on_url(url)

    def on_message_complete(self) -> None:
        self._in_headers = True  # whatever arrives next on this connection is a new request's head
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        self._disarm_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return  # already answered (414/431)
        self.transport.write(_problem_bytes(400, "Bad Request", msg))
        self.transport.close()
