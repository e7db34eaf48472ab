"""The Python floor: a bare uvloop + httptools server answering every request with an empty 200.

What a Python HTTP answer costs with nothing else in it; bench/run.py measures it in the same run as
the gateway and reports each door's CPU per request as a multiple of it.

    python bench/floor_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class Floor(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(ANSWER)


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(int(sys.argv[1])))
