"""A TLS upstream for the HTTP/2 and mutual-TLS tests: hypercorn (a real HTTP/2 server) serving a
small ASGI app that answers with what it saw: the HTTP version, the path and the request headers.

    python -m hypercorn tests.support.tls_upstream:app --certfile ... --keyfile ... [--ca-certs ... --verify-mode ...]
"""

from __future__ import annotations

import json
from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    length = 0
    more = True
    while more:
        message = await receive()
        length += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({
        "http_version": scope["http_version"],
        "path": scope["raw_path"].decode(),
        "query": scope["query_string"].decode(),
        "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
        "length": length,
    }).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
