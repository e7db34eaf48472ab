"""Admin writes without `admin.token` (issue 17, R5): loopback peers only was not enough. A page in
the operator's browser can POST to 127.0.0.1 (CSRF, a `text/plain` form needs no CORS preflight),
and a hostile name resolving to 127.0.0.1 (DNS rebinding) reaches it with the attacker's Host. So a
tokenless write also needs a loopback Host and no Origin other than the admin's own: 403 otherwise.
Reads stay open. The suite's gateway has no admin token."""

from __future__ import annotations

import json

import pytest

from tests.conformance.conftest import Deployed
from tests.support.raw_http import Conn

RESET = b"DELETE /limits/limited/hourly?key=admin-probe HTTP/1.1\r\n"
RELOAD = b"POST /reload HTTP/1.1\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n"


def admin(gateway: Deployed, request: bytes, *fields: str) -> tuple[int, dict[str, object]]:
    port = gateway.proc.admin_port
    lines = "".join(f"{field}\r\n" for field in fields).replace("{port}", str(port))
    with Conn(port) as conn:
        conn.send(request + lines.encode() + b"\r\n")
        status, _, body = conn.response()
    return status, json.loads(body) if body else {}


@pytest.mark.parametrize("fields", [
    ("Host: evil.example",),                                                  # DNS rebinding
    ("Host: evil.example:{port}",),
    ("Host: 127.0.0.1.evil.example:{port}",),
    ("Host: localhost.evil.example",),
    ("Host: 127.0.0.1:{port}", "Origin: http://evil.example"),                # CSRF from a page
    ("Host: 127.0.0.1:{port}", "Origin: null"),                               # a sandboxed page, a file
    ("Host: 127.0.0.1:{port}", "Origin: http://localhost:{port}"),            # another origin, same box
    ("Host: 127.0.0.1:{port}", "Origin: http://127.0.0.1:1"),
], ids=["host", "host-port", "host-suffix", "localhost-suffix", "origin", "origin-null", "origin-other-name",
        "origin-other-port"])
@pytest.mark.parametrize("request_line", [RELOAD, RESET], ids=["reload", "reset"])
def test_a_tokenless_admin_write_from_a_browser_or_a_rebound_name_is_refused(
        request_line: bytes, fields: tuple[str, ...], gateway: Deployed) -> None:
    status, problem = admin(gateway, request_line, *fields)
    assert status == 403, problem
    assert problem["status"] == 403


@pytest.mark.parametrize("fields", [
    ("Host: 127.0.0.1:{port}",),
    ("Host: localhost:{port}",),
    ("Host: LOCALHOST",),
    ("Host: [::1]:{port}",),
    ("Host: 127.0.0.1:{port}", "Origin: http://127.0.0.1:{port}"),  # the admin's own page
], ids=["ipv4", "localhost", "localhost-no-port", "ipv6", "own-origin"])
def test_a_tokenless_admin_write_from_the_machine_itself_is_accepted(
        fields: tuple[str, ...], gateway: Deployed) -> None:
    status, answer = admin(gateway, RESET, *fields)
    assert status == 200 and answer["key"], answer  # done (nothing was there to reset)


def test_admin_reads_need_no_loopback_host(gateway: Deployed) -> None:
    assert admin(gateway, b"GET /limits HTTP/1.1\r\n", "Host: evil.example")[0] == 200
