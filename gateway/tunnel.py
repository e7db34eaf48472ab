"""WebSocket tunnels: after the upstream's 101, bytes relayed both ways until either side closes.

The handshake was decided like any request (gateway/pipeline.py) and forwarded
(gateway/proxy.py); this module only joins the two connections that switched protocols, each an
httpcore-style network stream (gateway/http/upgraded.py): the upstream's, from the 101 response's
`network_stream` extension (LeanTransport's own, or httpcore's), and the client's, from the server's
`gateway.upgrade` ASGI extension (gateway/http/server.py). Frames are never parsed: the gateway
relays bytes, as nginx does.

Backpressure: a side is read only once the other has taken the last bytes, and each stream pauses
its socket past its high-water mark, so a slow reader stops its peer instead of filling memory.
A tunnel that carried no byte either way for `idle_timeout` seconds is closed; on shutdown, the
server cancels open tunnels once the drain timeout is over, which closes both sides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Protocol

from starlette.types import Scope

log = logging.getLogger("gateway.tunnel")

READ_BYTES = 256 * 1024  # the most one read takes from a side


class NetworkStream(Protocol):
    """httpcore's AsyncNetworkStream, as far as a tunnel uses it."""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes: ...
    async def write(self, buffer: bytes, timeout: float | None = None) -> None: ...
    async def aclose(self) -> None: ...


Accept = Callable[[list[tuple[bytes, bytes]]], Awaitable[Any]]


class TunnelEnd(StrEnum):
    """Why a tunnel closed."""

    CLIENT = "client"      # the client closed (or its connection failed)
    UPSTREAM = "upstream"  # the upstream closed (or its connection failed)
    IDLE = "idle"          # no byte either way for the idle timeout


def upgrade_acceptor(scope: Scope) -> Accept | None:
    """The server's hand-over of the client connection after a 101, when it offers one."""
    offered = scope.get("extensions", {}).get("gateway.upgrade")
    accept = offered.get("accept") if isinstance(offered, dict) else None
    return accept if callable(accept) else None


async def relay(client: NetworkStream, upstream: NetworkStream, idle_timeout: float) -> TunnelEnd:
    """Copy bytes both ways until a side closes or the tunnel idles; both streams are closed after."""
    loop = asyncio.get_running_loop()
    last = [loop.time()]

    async def pump(source: NetworkStream, sink: NetworkStream) -> None:
        try:
            while True:
                data = await source.read(READ_BYTES)
                if not data:
                    return
                last[0] = loop.time()
                await sink.write(data)
        except Exception as exc:  # either connection failed: the tunnel ends, as when it closes
            log.debug("tunnel side failed: %r", exc)

    async def idle() -> None:
        # one timer, slept again for whatever is left: a byte costs a float store, not a reschedule
        while (left := last[0] + idle_timeout - loop.time()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(left)

    up = asyncio.ensure_future(pump(client, upstream))
    down = asyncio.ensure_future(pump(upstream, client))
    watch = asyncio.ensure_future(idle())
    tasks = {up: TunnelEnd.CLIENT, down: TunnelEnd.UPSTREAM, watch: TunnelEnd.IDLE}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(tasks[task] for task in (watch, up, down) if task in done)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in (client, upstream):
            try:
                await stream.aclose()
            except Exception as exc:  # closing a connection that already failed
                log.debug("closing a tunnel side failed: %r", exc)


def switcher(accept: Accept, idle_timeout: float) -> Callable[[list[tuple[bytes, bytes]], Any], Awaitable[None]]:
    """What the proxy calls with an upstream's 101: the client is switched with the same headers,
    then the two are relayed until the tunnel closes."""
    async def switched(headers: list[tuple[bytes, bytes]], upstream: NetworkStream) -> None:
        try:
            client = await accept([*headers, (b"connection", b"upgrade"), (b"upgrade", b"websocket")])
        except ConnectionResetError:  # the client left while the upstream answered
            return
        end = await relay(client, upstream, idle_timeout)
        log.debug("tunnel closed: %s", end)

    return switched
