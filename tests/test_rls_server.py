"""The RLS port's HTTP/2 bounds against a hostile client (gateway/rls/server.py), driven with the h2
library as a raw client over a socket, and the shutdown that answers the calls in flight. The
gateway is a real process with a real Redis."""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx
import pytest
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame

from gateway.rls.server import MAX_MESSAGE
from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.rls_client import OK, Descriptor, RlsClient, decision_scripts, error_of, request

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
FILE = """\
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1000}
"""


class Raw:
    """One HTTP/2 client connection to the RLS port."""

    def __init__(self, port: int, settings: dict[h2.settings.SettingCodes, int] | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        if settings:
            self.conn.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        self.conn.initiate_connection()
        self.flush()
        self.unread = bytearray()  # the server's bytes, fed to h2 a frame at a time

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def call(self, body: bytes, end: bool = True, extra: list[tuple[bytes, bytes]] | None = None,
             send: bool = True) -> int:
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
                                        (b":authority", b"rls"), (b"content-type", b"application/grpc"),
                                        (b"te", b"trailers"), *(extra or [])])
        self.conn.send_data(stream, b"\0" + (len(body) if end else MAX_MESSAGE).to_bytes(4, "big") + body,
                            end_stream=end)
        if send:
            self.flush()
        return stream

    def events(self, until: float) -> Iterator[Any]:
        """Events as they come, until the server closes the connection or `until` passes. h2 takes
        no frame after the server's GOAWAY (the PING of a graceful close): those are read, not fed."""
        while time.monotonic() < until:
            self.sock.settimeout(max(0.01, until - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            except ConnectionResetError:
                yield "closed"
                return
            if not data:
                yield "closed"
                return
            self.unread += data
            while len(self.unread) >= 9 and len(self.unread) >= 9 + int.from_bytes(self.unread[:3], "big"):
                size = 9 + int.from_bytes(self.unread[:3], "big")
                frame = bytes(self.unread[:size])
                del self.unread[:size]
                if self.conn.state_machine.state is not h2.connection.ConnectionState.CLOSED:
                    yield from self.conn.receive_data(frame)
            self.flush()

    def close(self) -> None:
        self.sock.close()


def _serving(tmp: Path, redis_proc: RedisProcess, kind: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """A gateway serving FILE on its RLS port, on libnghttp2 ("lean") or on h2 (the comparison)."""
    (tmp / "d.yaml").write_text(FILE)
    rls_port = free_port()
    gateway = GatewayProcess("version: 1\nrls: {files: [d.yaml]}\n", tmp, redis_url=redis_proc.url,
                             args=("--rls-port", str(rls_port)), env=env, rls_server=kind)
    gateway.start()
    try:
        yield rls_port
    finally:
        assert gateway.stop() == 0
        assert "Traceback" not in gateway.log(), gateway.log()


@pytest.fixture(scope="module", params=["lean", "h2"])
def port(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         redis_proc: RedisProcess) -> Iterator[int]:
    """The RLS port on libnghttp2 (the gateway's) and on h2 (the comparison, gateway/rls/http2.py)."""
    yield from _serving(tmp_path_factory.mktemp("rls-server"), redis_proc, request.param)


def message(value: str = "v") -> bytes:
    return bytes(request("d", [("k", value)]).SerializeToString())


def goaway(events: Iterator[Any]) -> h2.events.ConnectionTerminated | None:
    for event in events:
        if isinstance(event, h2.events.ConnectionTerminated):
            return event
    return None


def test_unfinished_bodies_past_the_bound_end_the_connection(port: int) -> None:
    """Streams that never end their messages hold at most MAX_BUFFERED bytes of the worker's memory."""
    raw = Raw(port)
    seen: list[Any] = []
    try:
        def over() -> bool:
            return "closed" in seen or any(isinstance(e, h2.events.ConnectionTerminated) for e in seen)

        try:
            for _ in range(20):  # 20 streams of ~60 KiB, none ended, sent as the windows allow
                if over():
                    break
                stream = raw.call(b"", end=False)
                left = MAX_MESSAGE - 6000
                while left > 0 and not over():
                    size = min(16_000, left, raw.conn.local_flow_control_window(stream))
                    if size <= 0:
                        seen += list(raw.events(time.monotonic() + 0.2))
                        continue
                    raw.conn.send_data(stream, b"x" * size)
                    raw.flush()
                    left -= size
        except (BrokenPipeError, ConnectionResetError):  # the server ended it while we were still sending
            with contextlib.suppress(OSError):
                seen += list(raw.events(time.monotonic() + 2))
            seen.append("closed")
        ended = next((e for e in seen if isinstance(e, h2.events.ConnectionTerminated)), None)
        if ended is None and "closed" not in seen:
            ended = goaway(raw.events(time.monotonic() + 10))
        # GOAWAY ENHANCE_YOUR_CALM, unless the close reset it away before it was read
        assert (ended is not None and ended.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM) or "closed" in seen
    finally:
        raw.close()


def test_rapid_resets_end_the_connection(port: int) -> None:
    """HTTP/2 rapid reset (CVE-2023-44487): calls opened and reset at once, never answered. All are
    sent in one write: sent one by one, a busy test process left the server time to answer a third
    of them before their resets came, and answered calls are not an attack."""
    raw = Raw(port)
    try:
        for _ in range(300):
            stream = raw.call(message(), send=False)
            raw.conn.reset_stream(stream)
        raw.flush()
        ended = goaway(raw.events(time.monotonic() + within(10)))
        assert ended is not None and ended.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while we were still sending: the same outcome
    finally:
        raw.close()


def test_answers_wait_for_the_clients_window_then_all_come(port: int) -> None:
    """A client that opens no window gets its answers once it does, by WINDOW_UPDATE or SETTINGS."""
    raw = Raw(port, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    try:
        streams = [raw.call(message(f"w{n}")) for n in range(3)]
        deadline = time.monotonic() + 2
        data = [e for e in raw.events(deadline) if isinstance(e, h2.events.DataReceived)]
        assert data == []
        raw.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535})
        raw.flush()
        ended: set[int] = set()
        for event in raw.events(time.monotonic() + 10):
            if isinstance(event, h2.events.TrailersReceived):
                assert dict(event.headers)[b"grpc-status"] == b"0"
                ended.add(event.stream_id)
            if ended == set(streams):
                break
        assert ended == set(streams)
    finally:
        raw.close()


def test_headers_past_16_kib_are_refused(port: int) -> None:
    raw = Raw(port)
    try:
        raw.call(message(), extra=[(b"x-big", b"a" * 30_000)])
        events = list(raw.events(time.monotonic() + 5))
        assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events) or "closed" in events
        assert not any(isinstance(e, h2.events.TrailersReceived) for e in events)
    finally:
        raw.close()


def test_a_body_that_never_ends_and_a_connection_that_asks_nothing_time_out(short_idle_port: int) -> None:
    """GATEWAY_RLS_BODY_TIMEOUT and GATEWAY_RLS_IDLE_TIMEOUT (IDLE seconds here; 10 by default)."""
    asks_nothing = Raw(short_idle_port)
    stalls = Raw(short_idle_port)
    try:
        started = time.monotonic()
        stream = stalls.call(b"partial", end=False)
        reset = next((e for e in stalls.events(started + within(IDLE + 5)) if isinstance(e, h2.events.StreamReset)),
                     None)
        assert reset is not None and reset.stream_id == stream
        assert time.monotonic() - started >= IDLE  # not before its time
        assert "closed" in list(asks_nothing.events(time.monotonic() + within(IDLE + 5)))
    finally:
        asks_nothing.close()
        stalls.close()


def test_limits_from_descriptors_load_no_script_per_number(port: int, redis_proc: RedisProcess) -> None:
    """A descriptor's own limit and the order of descriptors never reach the script's text: Redis
    keeps every script it loads, so one per client-chosen number would grow it without end."""
    client = RlsClient(port)
    info = redis_proc.client()
    try:
        client.ask("d", Descriptor([("k", "warm")], limit=(5, 2)), [("k", "warm")])
        before = decision_scripts(info)
        for n in range(40):
            first, second = Descriptor([("k", f"a{n}")], limit=(random.randrange(1, 10**9), 2)), [("k", f"b{n}")]
            assert client.ask("d", *((first, second) if n % 2 else (second, first))).overall_code == OK
        assert decision_scripts(info) - before == 0
        many = [Descriptor([("k", f"m{n}")]) for n in range(33)]
        status, details = error_of(lambda: client.ask("d", *many))
        assert status is grpc.StatusCode.INVALID_ARGUMENT and "at most 32" in details
    finally:
        client.close()


def test_shutdown_answers_the_calls_in_flight(tmp_path: Path) -> None:
    """SIGTERM with calls waiting on Redis: GOAWAY, every call answered, then the worker exits."""
    server = RedisProcess()
    server.start()
    (tmp_path / "d.yaml").write_text(FILE)
    rls_port = free_port()
    gateway = GatewayProcess("version: 1\nredis: {timeout: 3s}\nrls: {files: [d.yaml]}\n", tmp_path,
                             redis_url=server.url, args=("--rls-port", str(rls_port)))
    gateway.start()
    client = RlsClient(rls_port)
    try:
        assert client.ask("d", [("k", "x")]).overall_code == OK
        sleeper = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", "1"))  # type: ignore[no-untyped-call]
        sleeper.start()
        time.sleep(0.1)  # the sleep is running: calls now wait on Redis
        answers: list[Any] = []

        def ask(n: int) -> None:
            try:
                answers.append(client.ask("d", [("k", f"s{n}")], timeout=10).overall_code)
            except grpc.RpcError as exc:
                answers.append(exc.code())

        callers = [threading.Thread(target=ask, args=(n,)) for n in range(5)]
        for caller in callers:
            caller.start()
        time.sleep(0.2)
        gateway.signal(signal.SIGTERM)
        for caller in callers:
            caller.join(15)
        sleeper.join(5)
        assert answers == [OK] * 5, answers
        assert gateway.process is not None and gateway.process.wait(15) == 0
    finally:
        client.close()
        gateway.stop()
        server.stop()
        assert "Traceback" not in gateway.log() and "never retrieved" not in gateway.log(), gateway.log()


def test_not_grpc_and_compressed_are_refused(port: int) -> None:
    """Plain HTTP/2 (another content type) gets HTTP's 415; a compressed message (flag 1) gRPC's
    UNIMPLEMENTED, in a trailers-only answer: nothing is guessed at, nothing counted."""
    path = f"http://127.0.0.1:{port}{PATH}"
    message = request("d", [("k", "compressed")]).SerializeToString()
    with httpx.Client(http1=False, http2=True) as client:
        plain = client.post(path, content=b"{}", headers={"content-type": "application/json"})
        assert plain.status_code == 415
        compressed = client.post(path, content=b"\x01" + len(message).to_bytes(4, "big") + message,
                                 headers={"content-type": "application/grpc", "te": "trailers"})
        assert compressed.headers["grpc-status"] == "12"
        assert "compressed" in compressed.headers["grpc-message"]
        torn = client.post(path, content=b"\x00\x00\x00\x00\x09abc", headers={"content-type": "application/grpc"})
        assert torn.headers["grpc-status"] == "3"


@pytest.fixture(scope="module", params=["lean", "h2"])
def short_idle_port(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    redis_proc: RedisProcess) -> Iterator[int]:
    """A gateway whose RLS connections may go IDLE seconds without a call, and whose calls' bodies
    must end within IDLE seconds, on either HTTP/2."""
    yield from _serving(tmp_path_factory.mktemp("rls-idle"), redis_proc, request.param,
                        {"GATEWAY_RLS_IDLE_TIMEOUT": str(IDLE), "GATEWAY_RLS_BODY_TIMEOUT": str(IDLE)})


IDLE = 2


def _ping(raw: Raw) -> bool:
    """PING, a SETTINGS and a WINDOW_UPDATE (frames that open no call); False once the server has
    ended the connection."""
    try:
        raw.conn.ping(b"12345678")
        raw.conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100})
        raw.conn.increment_flow_control_window(1024)
        raw.flush()
    except (BrokenPipeError, ConnectionResetError, h2.exceptions.ProtocolError):
        return False
    # a quarter of the idle time at most: the loop that pings two connections must still call on
    # the third well within IDLE, or the server closes that one too, rightly (a late ACK is read by
    # the next ping, a GOAWAY by the next read)
    for event in raw.events(time.monotonic() + IDLE / 4):
        if event == "closed" or isinstance(event, h2.events.ConnectionTerminated):
            return False
        if isinstance(event, h2.events.PingAckReceived):
            return True
    return True


def _ask(raw: Raw, value: str) -> bool:
    """One call answered OK; False once the server has ended the connection."""
    stream = raw.call(message(value))
    for event in raw.events(time.monotonic() + 5):
        if event == "closed" or isinstance(event, h2.events.ConnectionTerminated):
            return False
        if isinstance(event, h2.events.DataReceived):  # the window stays open for the next answers
            raw.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream:
            return dict(event.headers)[b"grpc-status"] == b"0"
    return False


def test_frames_without_a_call_do_not_keep_a_connection(short_idle_port: int) -> None:
    """PINGs alone (or SETTINGS, WINDOW_UPDATE) kept a connection for good, so they could fill the
    worker's connection slots: idle means no call, whatever else arrives. A connection that keeps
    calling stays."""
    never_called = Raw(short_idle_port)
    called_once = Raw(short_idle_port)
    calling = Raw(short_idle_port)
    try:
        assert _ask(called_once, "once")
        alive = {"never_called": True, "called_once": True}
        deadline = time.monotonic() + within(IDLE + 20)
        n = 0
        while any(alive.values()) and time.monotonic() < deadline:
            alive["never_called"] = alive["never_called"] and _ping(never_called)
            alive["called_once"] = alive["called_once"] and _ping(called_once)
            assert _ask(calling, f"c{n}"), "a connection making calls was closed"
            n += 1
        assert alive == {"never_called": False, "called_once": False}
        assert _ask(calling, "after")
    finally:
        for raw in (never_called, called_once, calling):
            raw.close()


def test_a_call_on_its_way_when_an_idle_connection_closes_is_answered(short_idle_port: int) -> None:
    """The idle close is graceful (RFC 9113 6.8): a first GOAWAY names the largest stream id, so a
    call the client sent before reading it (Envoy's next request, crossing it on the wire) is still
    answered; the final GOAWAY follows the client's PING ACK, and then the connection ends."""
    raw = Raw(short_idle_port)
    try:
        stream = raw.call(message("crossing"), send=False)
        call = raw.conn.data_to_send()  # made while the connection was open, sent once the GOAWAY is in
        goaway_seen, held = False, b""
        deadline = time.monotonic() + within(IDLE + 10)
        while not goaway_seen and time.monotonic() < deadline:
            raw.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = raw.sock.recv(65536)
            assert data, "closed without a GOAWAY"
            offset = 0
            while offset + 9 <= len(data):  # held: the frames after the GOAWAY (its PING) wait for the call
                frame, length = Frame.parse_frame_header(memoryview(data[offset:offset + 9]))
                if isinstance(frame, GoAwayFrame):
                    goaway_seen = True
                    held = data[offset:]
                    data = data[:offset]
                    break
                offset += 9 + length
            for _ in raw.conn.receive_data(data):
                pass
            raw.flush()
        assert goaway_seen
        raw.sock.sendall(call)
        frames = _frames_until_closed(raw, held, within(10))
        for frame in frames:
            if isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                raw.sock.sendall(PingFrame(0, frame.opaque_data, flags=["ACK"]).serialize())
        frames += _frames_until_closed(raw, b"", within(10))
        assert any(isinstance(f, DataFrame) and f.stream_id == stream and f.data for f in frames), frames
        assert any(isinstance(f, HeadersFrame) and f.stream_id == stream and "END_STREAM" in f.flags for f in frames)
        final = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert final and final[-1].last_stream_id == stream
    finally:
        raw.close()


def _frames_until_closed(raw: Raw, held: bytes, seconds: float) -> list[Any]:
    """The frames in `held` and those that come until the server closes (or `seconds` pass)."""
    data = bytearray(held)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        raw.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = raw.sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        data += chunk
        if held:  # the first call: what was held and what followed, before the PING's ACK goes out
            break
    frames, offset = [], 0
    while offset + 9 <= len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[offset:offset + 9]))
        frame.parse_body(memoryview(data[offset + 9:offset + 9 + length]))
        frames.append(frame)
        offset += 9 + length
    return frames


def test_an_answer_the_client_opens_no_window_for_does_not_keep_its_connection(short_idle_port: int) -> None:
    """A client that sets its window to 0 and never opens it (it acknowledges SETTINGS and PING, as
    any client does) held its connection, one of the worker's 4,096, for good: the answer waited
    for ever. It is reset after the body timeout, and the idle connection closes (an outside probe)."""
    raw = Raw(short_idle_port, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    try:
        raw.call(message("no-window"))
        events = list(raw.events(time.monotonic() + within(3 * IDLE + 10)))
        assert "closed" in events, events
        assert not any(isinstance(e, h2.events.DataReceived) for e in events)
    finally:
        raw.close()
