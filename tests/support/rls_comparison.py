"""The gateway with another HTTP/2 or gRPC layer under its RLS port, for comparison only (the RLS
suites run their cases through each; bench/rls.py measures each):

    python -m tests.support.rls_comparison grpclib serve --config ... --rls-port N   # grpclib's server
    python -m tests.support.rls_comparison h2 serve --config ... --rls-port N        # ours, on h2

The service behind it is the same RateLimitService; only the HTTP/2 and gRPC layer differ. No
product setting selects either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import sys
from collections.abc import Callable, Sequence
from typing import Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from gateway import cli
from gateway.app import compose
from gateway.config import Config
from gateway.rls.http2 import H2Engine
from gateway.rls.server import GrpcServer, Unary
from gateway.rls.service import GrpcError
from gateway.settings import Settings
from gateway.supervisor import configure_logging, run_worker, server_config


class RawCodec(CodecBase):
    """Messages as bytes: the service parses and builds them itself, as on the lean server."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> bytes:
        return data


class _Service:
    def __init__(self, calls: dict[bytes, Unary], now: dict[bytes, Callable[[bytes], bytes]]) -> None:
        self.mapping: dict[str, Handler] = {}
        for path, call in calls.items():
            self.mapping[path.decode()] = Handler(self._async(call), Cardinality.UNARY_UNARY, bytes, bytes)
        for path, answer in now.items():
            self.mapping[path.decode()] = Handler(self._sync(answer), Cardinality.UNARY_UNARY, bytes, bytes)

    def __mapping__(self) -> dict[str, Handler]:
        return self.mapping

    @staticmethod
    def _async(call: Unary) -> Callable[[Stream[bytes, bytes]], Any]:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            message = await stream.recv_message()
            assert message is not None
            try:
                answer = await call(message)
            except GrpcError as exc:
                raise GRPCError(Status(exc.status), exc.message) from None
            await stream.send_message(answer)
        return handle

    @staticmethod
    def _sync(answer: Callable[[bytes], bytes]) -> Callable[[Stream[bytes, bytes]], Any]:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            message = await stream.recv_message()
            assert message is not None
            try:
                await stream.send_message(answer(message))
            except GrpcError as exc:
                raise GRPCError(Status(exc.status), exc.message) from None
        return handle


class GrpclibServer(GrpcServer):
    """grpclib's Server behind GrpcServer's start and stop."""

    async def start(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        self.grpclib = Server([_Service(self.calls, self.now)], codec=RawCodec())
        await self.grpclib.start(sock=sock, ssl=tls)

    async def stop(self, timeout: float) -> None:
        self.grpclib.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.grpclib.wait_closed(), timeout)


def _run(settings: Settings, sockets: list[socket.socket], config: Config,
         replace: Callable[[GrpcServer], GrpcServer]) -> None:
    configure_logging(settings.log_level)
    composed = compose(settings, config)
    assert composed.rls_server is not None, "serve with --rls-port"
    composed = composed.__class__(composed.app, composed.lifecycle, composed.endpoint, replace(composed.rls_server))
    run_worker(settings, sockets, composed, server_config(settings, composed))


def grpclib_worker(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _run(settings, sockets, config, lambda lean: GrpclibServer(lean.calls, lean.now))


def h2_worker(settings: Settings, sockets: list[socket.socket], config: Config) -> None:
    _run(settings, sockets, config, lambda lean: GrpcServer(lean.calls, lean.now, lean.idle_timeout, H2Engine,
                                                            body_timeout=lean.body_timeout))


WORKERS = {"grpclib": grpclib_worker, "h2": h2_worker}  # module-level: a spawned worker imports them


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    kind, argv = (argv[0], argv[1:]) if argv and argv[0] in WORKERS else ("grpclib", argv)
    args = cli.parse_args(argv)
    assert args.command == "serve", "only `serve` has workers to compare"
    return cli.serve(cli.resolve_settings(args, os.environ), WORKERS[kind])


if __name__ == "__main__":
    sys.exit(main())
