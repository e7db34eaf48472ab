"""The client side: HTTP/1.1 on an asyncio protocol with httptools' request parser, serving the
gateway as an ASGI app. uvicorn still runs the process (sockets, lifespan, signals, graceful
shutdown); this class replaces its per-request machinery, which cost ~30 µs a request (a
hello-world ASGI app: 23k req/s under uvicorn's protocol, 79k on a bare httptools protocol).

What a proxy facing the internet needs, and uvicorn's protocol did not bound:
- the request line and headers together may not exceed `max_header_bytes` (431), the URL alone
  `MAX_URL_BYTES` (414); nothing past the bound is buffered;
- a client must finish sending its headers within `header_timeout` seconds of starting (408), and
  a connection that says nothing is closed after as long: slowloris connections are not held open;
- malformed requests, including conflicting Content-Length / Transfer-Encoding, are refused by the
  parser (400, problem+json) and never forwarded; a transfer-coding other than chunked and CONNECT
  are a 501. A request the parser refuses in the read that carried its head (a bad chunk size
  after it) never enters the app: neither counted nor forwarded;
- an absolute-form target's authority is the request's host (RFC 9112 3.2.2): the route, the
  limit and X-Forwarded-Host read it, not the Host field.
- a head of more than `MAX_HEADER_FIELDS` fields is a 431; a version other than 1.0 and 1.1 a 505;
  an absolute-form target of a scheme other than http and https a 400. An HTTP/1.0 client never
  receives a chunked body (the connection delimits it), and a 408 ends the connection.
Upgrades. A request llhttp reads as an Upgrade (`Connection: upgrade` + `Upgrade`) is never kept
alive: nothing after its head is parsed as HTTP again. Its scope carries the ASGI extension
`gateway.upgrade`, `{"accept": accept}`: `await accept(headers)` writes `101 Switching Protocols`
with `headers` and returns the client's connection as an `UpgradedStream` (gateway/http/upgraded.py,
httpcore's network-stream interface), holding whatever the client sent after the head; the
connection ends when the app returns. An app that answers anything else sends an ordinary
response, after which the connection closes: bytes sent after an Upgrade head are only ever read
as a tunnel, and only once the app accepted. On uvicorn's graceful shutdown an open tunnel is left
to run until the drain timeout, when uvicorn cancels its task and the connection closes.
Its settings, the early-answer hook and the doors come through uvicorn's config (`ServerConfig`),
which uvicorn hands to every connection's protocol. A port with a door (the check port) has its
requests answered by that callable, whose whole answer is written at once: no ASGI app, no ASGI
messages. One timer per connection covers the head and
keep-alive timeouts; it is armed when none is pending and, when it fires, sleeps again for
whatever is left, so a request arms none.

This module is the connection (`HttpProtocol`: parsing, bounds, timeouts, refusals, the order of
pipelined requests); beside it, as uvicorn splits its own protocol: gateway/http/exchange.py, one
request and its response (ASGI `receive` and `send`, the response head); gateway/http/flow_control.py,
reading and writing paused and the send timeout; gateway/http/early.py, the early answer's hook and
the turns a connection answered early sits out.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httptools
import uvicorn

from gateway.http.early import STEP_ASIDE, Door, EarlyAnswer, Turns
from gateway.http.exchange import ASGI, UPGRADE, Exchange, head_lines, problem_bytes
from gateway.http.flow_control import READ_HIGH_WATER, FlowControl
from gateway.http.upgraded import UpgradedStream
from gateway.settings import DEFAULTS

MAX_URL_BYTES = 8 * 1024
MAX_PIPELINED = 32  # requests queued behind one in progress; the next is a 503, the connection then ends
MAX_HEADER_FIELDS = 100  # fields in one request head (431 past it), as Kestrel's and Envoy's defaults


@dataclass(frozen=True)
class ServerOptions:
    """What the gateway sets of this protocol, handed to every connection through uvicorn's config."""

    max_header_bytes: int = DEFAULTS.max_head_bytes
    header_timeout: float = DEFAULTS.header_timeout
    # a client that takes nothing of its answer for this long is cut (nginx's send_timeout): its
    # call is cancelled, so its concurrency slots and its upstream connection go with it
    send_timeout: float = DEFAULTS.send_timeout
    # Asked before the application is entered, about keep-alive requests that expect a body in the
    # answer (not HEAD, no Expect): a whole answer (status, headers, a body its Content-Length
    # frames) is sent at once, with no task and no ASGI messages; None: the application serves it.
    early_answer: EarlyAnswer | None = None
    # Listening ports whose requests a Door answers, not the application (the check port's).
    doors: Mapping[int, Door] = field(default_factory=dict)


class ServerConfig(uvicorn.Config):
    """uvicorn's Config, serving the app with `HttpProtocol` and these options."""

    def __init__(self, app: Any, options: ServerOptions, **kwargs: Any) -> None:
        super().__init__(app, http=HttpProtocol, **kwargs)
        self.options = options


log = logging.getLogger("gateway.http")

class HttpProtocol(asyncio.Protocol):
    """One client connection. Constructed by uvicorn.Server like its own protocol classes."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        options = config.options if isinstance(config, ServerConfig) else ServerOptions()
        self.max_header_bytes = options.max_header_bytes
        self.header_timeout = options.header_timeout
        self.send_timeout = options.send_timeout
        self.early_answer = options.early_answer
        self.doors = options.doors
        self.door: Door | None = None  # this connection's port's, if it has one
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.keep_alive_timeout = float(config.timeout_keep_alive)
        self.parser = httptools.HttpRequestParser(self)
        # After a request that closes the connection (`Connection: close`, HTTP/1.0), llhttp skips
        # whatever follows instead of failing the whole read: that request is still answered (no
        # 400 in its place, as uvicorn's protocol does), and the bytes after it are never parsed
        # as a request (tests/conformance: close-then-pipelined).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.exchange: Exchange | None = None
        self.pipeline: deque[Exchange] = deque()
        self.flow: FlowControl = None  # type: ignore[assignment]
        # the request being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_complete = False    # past the head: any further field is a trailer
        self.parsed_head_bytes = 0    # name + value + 4 per field of the head being parsed
        self.expect_100 = False
        self.codings: list[bytes] = []  # Transfer-Encoding values of the head being read
        # bounds and timeouts
        self.in_head = True           # between requests or inside a head: bytes count against the bound
        self.head_bytes = 0
        self.head_started = 0.0       # first byte of the head being received (0: none begun)
        self.idle_since = 0.0
        self.served = 0
        self.timer: asyncio.TimerHandle | None = None
        self.deferred_refusal = b""   # a bad pipelined request: answered after those before it
        self.upgraded = False         # an Upgrade head was read: nothing after it is ever parsed
        self.early = b""              # bytes after an Upgrade head, kept until the app accepts it
        self.tunnel: UpgradedStream | None = None  # the upgrade was accepted: bytes go here
        self.body_delivered = 0       # body bytes the parser has handed over on this connection
        self.framing_bytes = 0        # bytes read since the last body bytes (chunk framing, trailers)
        # answered early: the next STEP_ASIDE turns of the loop, what arrives waits in `stashed`
        self.turns = Turns.of(self.loop)
        self.aside = False
        self.stashed = b""
        self.stash_paused = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.flow = FlowControl(self.transport, self.loop, self.send_timeout, self._cut_off)
        self.connections.add(self)
        sockname = transport.get_extra_info("sockname")
        peername = transport.get_extra_info("peername")
        self.server = (str(sockname[0]), int(sockname[1])) if isinstance(sockname, tuple) else None
        if self.server is not None and self.doors:
            self.door = self.doors.get(self.server[1])
        self.client = (str(peername[0]), int(peername[1])) if isinstance(peername, tuple) else None
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self.idle_since = self.loop.time()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for exchange in (self.exchange, *self.pipeline):
            if exchange is not None and not exchange.response_complete:
                exchange.disconnected = True
                exchange.wake()
        if self.tunnel is not None:
            self.tunnel.end()
        else:
            self._cancel_gone(self.exchange)
        self.flow.lost()

    @staticmethod
    def _cancel_gone(exchange: Exchange | None) -> None:
        """The client closed its connection while its request was in the app: nobody will read the
        answer, so the app's call is cancelled at once, as nginx does (proxy_ignore_client_abort
        off): the upstream request is abandoned (its connection closed), a leaky bucket's wait or a
        WebSocket handshake ends, concurrency slots go back and settlement sees a 499."""
        if exchange is None or exchange.response_complete or exchange.task is None or exchange.task.done():
            return
        exchange.gone = True
        exchange.task.cancel()

    def eof_received(self) -> bool:
        """The client closed its side. As nginx reads it (proxy_ignore_client_abort off): the client
        has gone, and a request of its still in the app is cancelled (`_cancel_gone`, once the
        transport closes). A tunnel is told, and the app closes it. Only a request not yet in the
        app (nothing has been counted or forwarded) is still answered, then the connection ends."""
        if self.tunnel is not None:
            self.tunnel.end()
            return True
        exchange = self.exchange
        if exchange is not None and not exchange.response_complete and not exchange.more_body:
            if exchange.task is not None:
                return False  # the transport closes: connection_lost cancels the call
            exchange.keep_alive = False
            return True  # keep the write side open for the answer
        return False

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel.feed(data)
            return
        if self.upgraded and not self.deferred_refusal:
            # held until the app accepts the upgrade (or the connection ends); reading is paused
            # since the Upgrade head, and again if a pipelined request's end resumed it
            self.early += data
            if len(self.early) > READ_HIGH_WATER:
                self.flow.pause_reading()
            return
        if self.deferred_refusal or self.upgraded:
            # the parser failed on this connection, or read an Upgrade head: nothing more is read
            # (reading resumes for the requests pipelined before, and must not feed the parser)
            return
        if self.aside:  # answered early a moment ago: kept until `step_back`
            self.stashed += data
            if len(self.stashed) > READ_HIGH_WATER and not self.flow.read_paused:
                self.stash_paused = True
                self.flow.pause_reading()
            return
        # One read may carry the head and the start of a large body: judge the head only if it is
        # still incomplete after this read (what is buffered stays below the bound plus one read).
        counting = self.in_head
        if counting:
            self.head_bytes += len(data)
        delivered = self.body_delivered
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # The parser stops at an Upgrade head: the app accepts it (a tunnel), or answers and
            # the connection ends after that answer; what follows the head is never parsed.
            self.upgraded = True
            offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
            self.early = data[offset:]
            exchange = self.pipeline[-1] if self.pipeline else self.exchange
            if exchange is not None:
                exchange.keep_alive = False
                exchange.more_body = False
                exchange.wake()
            self.flow.pause_reading()
            return
        except httptools.HttpParserError as exc:
            if not self.transport.is_closing():
                self._refuse(400, f"invalid HTTP request: {exc}")
            return
        if counting and self.in_head and self.head_bytes > self.max_header_bytes + MAX_URL_BYTES:
            self._refuse(431, f"request line and headers exceed {self.max_header_bytes // 1024} KiB")
        elif not counting and not self.in_head:
            # Inside a body: reads that carry no body bytes are chunk framing or trailers, which
            # llhttp buffers field by field; bounded like a head, however they trickle in.
            if self.body_delivered == delivered:
                self.framing_bytes += len(data)
                if self.framing_bytes > self.max_header_bytes:
                    self._refuse(431, f"chunk framing or trailers exceed {self.max_header_bytes // 1024} KiB")
            else:
                self.framing_bytes = 0

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    # --- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.head_complete = False
        self.parsed_head_bytes = 0
        self.framing_bytes = 0
        self.expect_100 = False
        self.codings = []
        self.in_head = True
        self.head_started = self.loop.time()
        self._arm()

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL_BYTES:
            self._refuse(414, f"the URL exceeds {MAX_URL_BYTES // 1024} KiB")
            raise httptools.HttpParserError("URL too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_complete:
            return  # a trailer field: never a header (RFC 9110 section 6.5.1), dropped
        if len(self.headers) >= MAX_HEADER_FIELDS:
            # thousands of empty fields fit in the byte bound, and each costs Python objects in
            # every place that reads the head: bounded by count as well
            self._refuse(431, f"more than {MAX_HEADER_FIELDS} header fields")
            raise httptools.HttpParserError("too many fields")
        self.parsed_head_bytes += len(name) + len(value) + 4
        if self.parsed_head_bytes > self.max_header_bytes:
            # counted field by field, so one read carrying a whole oversized head is caught too
            self._refuse(431, f"request headers exceed {self.max_header_bytes // 1024} KiB")
            raise httptools.HttpParserError("head too large")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100 = True
        elif name == b"transfer-encoding":
            self.codings.append(value)
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_complete = True
        self.head_bytes = 0
        self.head_started = 0.0
        parser = self.parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":  # llhttp lets HTTP/2.0 and HTTP/0.9 request lines through
            self._refuse(505, f"HTTP/{version} is not supported (only 1.0 and 1.1)")
            raise httptools.HttpParserError("version")
        method = parser.get_method()
        if method == b"CONNECT":  # its target is an authority, not a path: no tunnel through the gateway
            self._refuse(501, "CONNECT is not supported")
            raise httptools.HttpParserError("CONNECT")
        codings = self.codings
        if codings and b",".join(codings).rsplit(b",", 1)[-1].strip().lower() != b"chunked":
            # llhttp fails such a request right after this callback (its length is unknown); the
            # answer, as nginx's, is a 501, and the app is never entered
            coding = b",".join(codings).strip()[:64].decode("latin-1")
            self._refuse(501, f"transfer-coding {coding!r} is not supported (only chunked)")
            raise httptools.HttpParserError("transfer-coding")
        parsed = httptools.parse_url(self.url)
        if parsed.schema is not None and parsed.schema.lower() not in (b"http", b"https"):
            self._refuse(400, "an absolute-form target must be http or https")
            raise httptools.HttpParserError("scheme")
        if parsed.host:
            self._absolute_form(parsed, version)
        raw_path: bytes = parsed.path or b"/"
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http", "asgi": ASGI, "http_version": version, "server": self.server,
            "client": self.client, "scheme": self.scheme, "method": method.decode("ascii"),
            "root_path": "", "path": path, "raw_path": raw_path, "query_string": parsed.query or b"",
            "headers": self.headers, "state": self.app_state.copy(),
        }
        upgrade = parser.should_upgrade()  # never kept alive, never answered early: what follows is not HTTP
        exchange = Exchange(self, scope, version != "1.0" and parser.should_keep_alive() and not upgrade,
                            self.expect_100)
        if upgrade:
            scope["extensions"] = {UPGRADE: {"accept": exchange.accept_upgrade}}
        if self.exchange is None or self.exchange.response_complete:
            if (self.early_answer is None or self.door is not None or self.expect_100 or not exchange.keep_alive
                    or scope["method"] == "HEAD" or not self._answer_early(exchange)):
                self._start(exchange)
        else:  # pipelined behind a response still in progress
            if len(self.pipeline) >= MAX_PIPELINED:  # one read could queue thousands: MiBs a connection
                self._refuse(503, f"more than {MAX_PIPELINED} requests pipelined behind one in progress")
                raise httptools.HttpParserError("too many pipelined requests")
            self.flow.pause_reading()
            self.pipeline.append(exchange)

    def _absolute_form(self, parsed: Any, version: str) -> None:
        """`GET http://host/path`: the target's authority is the request's host (RFC 9112 3.2.2, and
        nginx's $host), so it replaces the value of every Host line. The Host lines are still
        required on HTTP/1.1 and counted (none or two: 400, as nginx), and the authority is checked
        as a Host."""
        if parsed.userinfo is not None:
            self._refuse(400, "a target with userinfo is ambiguous")
            raise httptools.HttpParserError("userinfo")
        host: bytes = parsed.host
        authority = b"[%b]" % host if b":" in host else host
        if parsed.port is not None:
            authority += b":%d" % parsed.port
        if any(name == b"host" for name, _ in self.headers):
            self.headers = [(name, authority if name == b"host" else value) for name, value in self.headers]
        elif version == "1.0":  # no Host needed: the authority is the one
            self.headers.append((b"host", authority))

    def on_body(self, body: bytes) -> None:
        self.body_delivered += len(body)
        exchange = self.pipeline[-1] if self.pipeline else self.exchange
        if exchange is None or exchange.response_complete:
            return
        exchange.body += body
        if len(exchange.body) > READ_HIGH_WATER:
            self.flow.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        self.in_head = True  # whatever arrives next on this connection is a new request's head
        exchange = self.pipeline[-1] if self.pipeline else self.exchange
        if exchange is None or exchange.response_complete:
            return
        exchange.more_body = False
        exchange.wake()

    # --- the app -------------------------------------------------------------------------------

    def _answer_early(self, exchange: Exchange) -> bool:
        """Answer without the application when `early_answer` has the answer (in order: only when
        no response is in progress). The request's body, if any, is read and dropped by the parser."""
        assert self.early_answer is not None
        try:
            answer = self.early_answer(exchange.scope)
        except Exception:
            log.exception("answering a request early failed; the application serves it")
            return False
        if answer is None:
            return False
        exchange.response_started = True
        self.exchange = exchange
        status, headers, body = answer
        self.transport.write(head_lines(status, headers) + b"\r\n" + body)
        exchange.response_complete = True
        self.response_done(exchange)
        if STEP_ASIDE and not self.transport.is_closing():
            # This connection's next request waits STEP_ASIDE turns of the event loop: a flood
            # answered from memory never fills the turns an honest request needs (its Redis reply,
            # its upstream's answer). bench/flood.py measures both sides.
            self.aside = True
            self.turns.wait(self, STEP_ASIDE)
        return True

    def step_back(self) -> None:
        """STEP_ASIDE turns have passed: what arrived meanwhile is read now."""
        self.aside = False
        if self.stashed and not self.transport.is_closing():
            data, self.stashed = self.stashed, b""
            if self.stash_paused:
                self.stash_paused = False
                self.flow.resume_reading()
            self.data_received(data)

    def _start(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.flow.answer_begins()
        task = exchange.task = self.loop.create_task(self._run(exchange))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        if exchange.refused:
            return  # the parser refused it (a malformed body in the read that carried its head)
        exchange.entered = True
        try:
            door = self.door
            if door is None:
                await self.app(exchange.scope, exchange.receive, exchange.send)
            else:
                answer = await door(exchange.scope, exchange.receive)
                if answer is not None:
                    exchange.answer(*answer)
        except asyncio.CancelledError:
            if self.tunnel is not None:  # a tunnel still open at the end of the drain timeout
                self.transport.close()
                raise
            if exchange.gone:  # the client left (`_cancel_gone`): the app has let go of everything
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                return
            log.warning("a request was still in flight at the end of the drain timeout: cut off")
            if not exchange.response_started and not self.transport.is_closing():
                self._refuse(503, "the gateway is shutting down")
            else:
                self.transport.close()
            raise
        except BaseException as exc:
            self._failed(exchange, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not exchange.response_complete and not exchange.disconnected:
            # a response broken off (the upstream failed mid-body): never made to look complete
            self.transport.close()

    def _failed(self, exchange: Exchange, exc: BaseException) -> None:
        """The request in service failed: its 500 now (not `_refuse`, which would wait for the
        request in service to end first: this one, so it never came), and the connection ends, with
        whatever was pipelined after it."""
        log.error("exception in the request handler", exc_info=exc)
        if not exchange.response_started and not self.transport.is_closing():
            self.transport.write(problem_bytes(500, "the gateway failed to handle the request"))
        self.transport.close()

    def response_done(self, exchange: Exchange) -> None:
        self.server_state.total_requests += 1
        self.served += 1
        if self.transport.is_closing():
            return
        if not exchange.keep_alive:
            self.transport.close()
            return
        if self.pipeline:
            if not self.deferred_refusal:
                self.flow.resume_reading()
            self._start(self.pipeline.popleft())
        elif self.deferred_refusal:
            self.transport.write(self.deferred_refusal)
            self.transport.close()
        else:
            self.flow.resume_reading()
            self.idle_since = self.loop.time()
            self._arm()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close when idle, else after the response in flight (a
        tunnel runs on until uvicorn cancels it at the end of its graceful timeout)."""
        if self.exchange is None or self.exchange.response_complete:
            self.transport.close()
        else:
            self.exchange.keep_alive = False

    # --- flow control --------------------------------------------------------------------------

    def pause_side(self) -> None:  # gateway.http.upgraded.Side
        self.flow.pause_reading()

    def resume_side(self) -> None:
        self.flow.resume_reading()

    async def writable(self, written: int) -> None:
        flow = self.flow
        if not self.transport.is_closing() and flow.took_nothing(written):
            flow.cut()
        if flow.write_paused and not self.transport.is_closing():
            await flow.drain()
        if self.transport.is_closing():
            raise ConnectionResetError("the client connection is closed")

    def _cut_off(self) -> None:
        """The client is cut for taking nothing: its app's next sends go nowhere, and
        connection_lost cancels its call."""
        if self.exchange is not None:
            self.exchange.disconnected = True

    # --- timeouts and refusals -----------------------------------------------------------------

    def _arm(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_later(min(self.header_timeout, self.keep_alive_timeout), self._check)

    def _check(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        exchange = self.exchange
        if exchange is not None and not exchange.response_complete:
            return  # a request in progress; its response's end arms the timer again
        now = self.loop.time()
        if self.head_started:  # a head is arriving
            left = self.head_started + self.header_timeout - now
            if left <= 0:
                self._refuse(408, f"request headers not received within {self.header_timeout:.0f}s")
                return
        else:  # silent since connecting, or idle between requests
            left = self.idle_since + (self.keep_alive_timeout if self.served else self.header_timeout) - now
            if left <= 0:
                self.transport.close()
                return
        self.timer = self.loop.call_later(left, self._check)

    def _refuse(self, status: int, detail: str) -> None:
        """Answer a request the parser refused and end the connection. Requests received whole
        before it are answered first, in order: the refusal never takes another request's place."""
        log.info("refused a request: %s", detail)
        if self.deferred_refusal:
            return  # already refused (a 414/431 from a callback, then the parser's own error)
        current = self.exchange
        if current is not None and current.response_started and not current.response_complete:
            self.transport.close()  # never written into the middle of a response: the connection ends
            return
        answer = problem_bytes(status, detail)
        if current is not None and current.more_body and not current.entered and not current.response_started:
            # refused in the read that carried its head: the app, whose task has not run yet, is
            # never entered, so the request is neither counted nor forwarded
            current.refused = True
        if self.pipeline and self.pipeline[-1].more_body:
            self.pipeline.pop()  # the refused request itself, queued but never started: it never will be
        if self.pipeline or (current is not None and not current.response_complete and not current.more_body):
            self.deferred_refusal = answer
            self.flow.pause_reading()
            return
        self.transport.write(answer)
        self.transport.close()
