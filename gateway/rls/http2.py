"""The HTTP/2 under the RLS port's gRPC server, behind one seam.

`Ngh2Engine` (libnghttp2, through ngh2's sans-I/O binding) is what the gateway runs; `H2Engine` (the
h2 library, in pure Python) is the comparison the RLS suites and bench/rls.py also run on, built by
them, never by a product setting. Both do the framing, HPACK, flow control, SETTINGS, PING and
GOAWAY; gateway/rls/server.py sees the same few events from either and asks the same few things.

    receive(data) -> events     REQUEST (headers, ended), DATA (bytes), END, RESET, WINDOW, GOAWAY,
                                PONG (a PING's ACK: its data);
                                Http2Failure when the client broke the protocol (the engine has
                                queued its GOAWAY: send what `outbound` gives, then close)
    headers / data / trailers   one stream's answer; a stream the client reset meanwhile takes nothing
    window(stream)              bytes the client's flow control lets the answer send now
    reset, close, drain         RST_STREAM; GOAWAY closing; GOAWAY naming the last stream taken,
                                the connection still answering the calls in flight
    notice(ping)                RFC 9113 6.8's first GOAWAY (the largest stream id) and a PING
    outbound()                  the bytes to write
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import ngh2
from hyperframe.frame import GoAwayFrame

REQUEST, DATA, END, RESET, WINDOW, GOAWAY, PONG = range(7)
Event = tuple[int, int, Any]  # kind, stream id, payload (headers and whether they end the stream; data)
Headers = list[tuple[bytes, bytes]]

PROTOCOL_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x1, 0x7, 0x8, 0xB


class Http2Failure(Exception):
    """The client broke HTTP/2; the engine's GOAWAY is queued."""


class Engine(Protocol):
    def receive(self, data: bytes) -> list[Event]: ...
    def headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None: ...
    def data(self, stream_id: int, data: bytes) -> None: ...
    def trailers(self, stream_id: int, headers: Headers) -> None: ...
    def window(self, stream_id: int) -> int: ...
    def reset(self, stream_id: int, code: int) -> None: ...
    def close(self, code: int = 0) -> None: ...
    def drain(self, last_stream_id: int) -> None: ...
    def notice(self, ping: bytes) -> None: ...
    def outbound(self) -> bytes: ...


EngineFactory = Callable[[int, int], Engine]  # (max concurrent streams, max header list bytes)


class Ngh2Engine:
    """libnghttp2: it also bounds what it is sent (resets, glitches, CONTINUATION floods)."""

    __slots__ = ("conn", "early", "last")

    def __init__(self, max_streams: int, max_header_list: int) -> None:
        self.last = 0  # the highest stream the client opened
        self.early = b""  # frames to send first: the GOAWAY for a client that broke the protocol, or a notice
        config = ngh2.Configuration(max_inbound_header_list_size=max_header_list)
        self.conn = ngh2.Connection(ngh2.Role.SERVER, config)
        self.conn.initiate_connection({ngh2.Setting.MAX_CONCURRENT_STREAMS: max_streams,
                                       ngh2.Setting.MAX_HEADER_LIST_SIZE: max_header_list})

    def receive(self, data: bytes) -> list[Event]:
        conn = self.conn
        try:
            conn.receive_data(data)
        except ngh2.ProtocolError as exc:
            # libnghttp2 leaves such a connection unusable, its GOAWAY unsent: written here instead
            code = ENHANCE_YOUR_CALM if isinstance(exc, ngh2.DenialOfServiceError) else PROTOCOL_ERROR
            self.early = _goaway(self.last, code)
            raise Http2Failure(str(exc)) from None
        out: list[Event] = []
        for event in conn.events():
            if isinstance(event, ngh2.DataReceived):
                out.append((DATA, event.stream_id, event.data))
                if event.end_stream:
                    out.append((END, event.stream_id, None))
            elif isinstance(event, ngh2.RequestReceived):
                self.last = event.stream_id
                out.append((REQUEST, event.stream_id, (list(event.headers), event.end_stream)))
            elif isinstance(event, ngh2.TrailersReceived):  # a request's trailers end it
                out.append((END, event.stream_id, None))
            elif isinstance(event, ngh2.StreamReset):
                out.append((RESET, event.stream_id, None))
            elif isinstance(event, (ngh2.WindowUpdated, ngh2.SettingsReceived)):
                out.append((WINDOW, 0, None))
            elif isinstance(event, ngh2.GoAwayReceived):
                out.append((GOAWAY, 0, None))
            elif isinstance(event, ngh2.PingAcknowledged):
                out.append((PONG, 0, event.opaque_data))
        return out

    # every answer's three calls: `try` costs nothing, contextlib.suppress 0.26 µs a call
    def headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None:
        try:  # noqa: SIM105
            self.conn.send_response(stream_id, headers, end_stream=end_stream)
        except ngh2.NGH2Error:  # a stream the client reset meanwhile
            pass

    def data(self, stream_id: int, data: bytes) -> None:
        try:  # noqa: SIM105
            self.conn.send_data(stream_id, data)
        except ngh2.NGH2Error:
            pass

    def trailers(self, stream_id: int, headers: Headers) -> None:
        try:  # noqa: SIM105
            self.conn.send_trailers(stream_id, headers)
        except ngh2.NGH2Error:
            pass

    def window(self, stream_id: int) -> int:
        try:
            return min(self.conn.stream_remote_window_size(stream_id), self.conn.remote_window_size)
        except ngh2.NGH2Error:
            return 0

    def reset(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(ngh2.NGH2Error):
            self.conn.reset_stream(stream_id, code)

    def close(self, code: int = 0) -> None:
        with contextlib.suppress(ngh2.NGH2Error):
            self.conn.terminate_connection(code)

    def drain(self, last_stream_id: int) -> None:
        with contextlib.suppress(ngh2.NGH2Error):
            self.conn.send_goaway(0, last_stream_id=last_stream_id)

    def notice(self, ping: bytes) -> None:
        with contextlib.suppress(ngh2.NGH2Error):
            self.conn.send_shutdown_notice()
            self.early = self.conn.data_to_send()  # libnghttp2 would send the PING ahead of the GOAWAY
            self.conn.ping(ping)

    def outbound(self) -> bytes:
        early, self.early = self.early, b""
        try:
            return early + self.conn.data_to_send()
        except ngh2.NGH2Error:  # a connection libnghttp2 has ended: its GOAWAY went with the last bytes
            return early


_H2_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # h2's own checks of every header field cost more than the call; only :method, :path and
    # content-type are read, and the server checks each
    validate_inbound_headers=False, validate_outbound_headers=False,
    normalize_inbound_headers=False, normalize_outbound_headers=False,
)


class H2Engine:
    """The h2 library: HTTP/2 in pure Python (the comparison)."""

    __slots__ = ("conn", "extra")

    def __init__(self, max_streams: int, max_header_list: int) -> None:
        self.conn = h2.connection.H2Connection(config=_H2_CONFIG)
        self.extra = b""  # h2's bytes, then a GOAWAY h2 would not send without closing the connection
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list,
        })
        self.conn.initiate_connection()
        self.conn.decoder.max_header_list_size = max_header_list  # h2 applies it only on a settings ACK

    def receive(self, data: bytes) -> list[Event]:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued its GOAWAY
            raise Http2Failure(str(exc)) from None
        out: list[Event] = []
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                out.append((REQUEST, event.stream_id, (event.headers, event.stream_ended is not None)))
            elif isinstance(event, h2.events.DataReceived):
                if event.flow_controlled_length:
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                out.append((DATA, event.stream_id, event.data))
            elif isinstance(event, h2.events.StreamEnded):
                out.append((END, event.stream_id, None))
            elif isinstance(event, h2.events.StreamReset):
                out.append((RESET, event.stream_id, None))
            elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                out.append((WINDOW, 0, None))
            elif isinstance(event, h2.events.ConnectionTerminated):
                out.append((GOAWAY, 0, None))
            elif isinstance(event, h2.events.PingAckReceived):
                out.append((PONG, 0, event.ping_data))
        return out

    def headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.send_headers(stream_id, headers, end_stream=end_stream)

    def data(self, stream_id: int, data: bytes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.send_data(stream_id, data)

    def trailers(self, stream_id: int, headers: Headers) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.send_headers(stream_id, headers, end_stream=True)

    def window(self, stream_id: int) -> int:
        try:
            return int(self.conn.local_flow_control_window(stream_id))
        except h2.exceptions.ProtocolError:
            return 0

    def reset(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes(code))

    def close(self, code: int = 0) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(h2.errors.ErrorCodes(code))

    def drain(self, last_stream_id: int) -> None:
        self.extra += self.conn.data_to_send() + _goaway(last_stream_id, 0)

    def notice(self, ping: bytes) -> None:
        self.extra += self.conn.data_to_send() + _goaway(2**31 - 1, 0)  # the GOAWAY before the PING
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.ping(ping)

    def outbound(self) -> bytes:
        data = self.conn.data_to_send()
        if self.extra:
            data, self.extra = self.extra + data, b""
        return data


def _goaway(last_stream_id: int, code: int) -> bytes:
    frame = GoAwayFrame(0)
    frame.last_stream_id = last_stream_id
    frame.error_code = code
    return bytes(frame.serialize())
