"""problem+json (RFC 9457): every answer the gateway makes itself carries one."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

Headers = list[tuple[bytes, bytes]]
PROBLEM = b"application/problem+json"


def problem(status: int, detail: str, **extra: Any) -> tuple[int, Headers, bytes]:
    """A problem answer: its status, its headers (content type and length) and its body."""
    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    body.update(extra)
    data = json.dumps(body).encode()  # its default separators are ", " and ": " (and its encoder is cached)
    return status, [(b"content-type", PROBLEM), (b"content-length", str(len(data)).encode())], data
