"""A real WebSocket upstream (the `websockets` package) for the tunnel tests, run as a subprocess.

    /echo...     every message sent back as it came
    /sink        messages counted, not kept; the text "end" is answered with the byte count
    /source/N    N MiB sent in 1 MiB messages, then the connection is closed
    /drip        a 4 KiB message every 0.1 s until the connection closes
    /refuse      no switch: 403 with a body (an ordinary HTTP answer to a handshake)
    /handshakes  (plain GET) how many handshakes reached this server, as text
"""

from __future__ import annotations

import argparse
import asyncio
import http

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from tests.support.upstream import Upstream

HANDSHAKES = 0
MiB = 1 << 20


async def handler(ws: ServerConnection) -> None:
    path = ws.request.path if ws.request is not None else ""
    if path == "/sink":
        received = 0
        async for message in ws:
            if message == "end":
                await ws.send(str(received))
            else:
                received += len(message)
    elif path == "/drip":
        piece = b"d" * 4096
        while True:
            await ws.send(piece)
            await asyncio.sleep(0.1)
    elif path.startswith("/source/"):
        piece = b"s" * MiB
        for _ in range(int(path.rsplit("/", 1)[1])):
            await ws.send(piece)
    else:
        async for message in ws:
            await ws.send(message)


def process_request(connection: ServerConnection, request: Request) -> Response | None:
    global HANDSHAKES
    if request.path == "/handshakes":
        return connection.respond(http.HTTPStatus.OK, f"{HANDSHAKES}\n")
    HANDSHAKES += 1
    if request.path == "/refuse":
        return connection.respond(http.HTTPStatus.FORBIDDEN, "no tunnel here\n")
    return None


async def run(port: int) -> None:
    async with serve(handler, "127.0.0.1", port, process_request=process_request, max_size=None,
                     compression=None) as server:
        await server.serve_forever()


class WsUpstream(Upstream):
    """Runs this module in a subprocess on a free port."""

    module = "tests.support.ws_upstream"

    def handshakes(self) -> int:
        import httpx

        return int(httpx.get(f"{self.url}/handshakes", timeout=5).text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(run(parser.parse_args().port))


if __name__ == "__main__":
    main()
