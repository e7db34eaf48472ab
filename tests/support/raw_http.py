"""A raw HTTP/1.1 client connection for tests that must control every byte a client sends."""

from __future__ import annotations

import socket


class Conn:
    """A raw client connection that reads whole responses (Content-Length or chunked)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(5)
        self.buffer = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                raise ConnectionError("closed mid-response")
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError("closed mid-response")
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def response(self, head_only: bool = False) -> tuple[int, dict[bytes, bytes], bytes]:
        status = int(self._line().split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if head_only or status in (100, 204, 304):
            return status, headers, b""
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while size := int(self._line(), 16):
                body += self._take(size)
                self._line()
            self._line()
            return status, headers, body
        return status, headers, self._take(int(headers[b"content-length"]))

    def closed_by_peer(self) -> bool:
        try:
            return not self.buffer and not self.sock.recv(1)
        except (ConnectionResetError, TimeoutError):
            return False
