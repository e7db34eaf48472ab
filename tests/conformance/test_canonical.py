"""The canonical request end to end, on every server protocol and transport: the probe's bytes
(issue 17 V1, V5) against a real gateway and a logging upstream."""

from __future__ import annotations

import uuid

import pytest

from tests.conformance.conftest import Deployed
from tests.conformance.test_client_side import req, run_case
from tests.conformance.upstream import LoggingUpstream

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)


@pytest.mark.parametrize("variant", [b"alice ", b"alice  ", b"alice\t", b" alice"])
def test_whitespace_around_an_identity_is_the_same_client(
        variant: bytes, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    user = f"u{uuid.uuid4().hex[:8]}".encode()
    first, _, _ = run_case(gateway, logging_upstream, req("GET", "/limited-user/a", f"X-User-Id: {user.decode()}"))
    assert first == [200]
    raw = req("GET", "/limited-user/b")
    raw = raw.replace(b"X-Request-Id: rid", b"X-Request-Id: rid\r\nX-User-Id: " + variant.replace(b"alice", user))
    statuses, received, _ = run_case(gateway, logging_upstream, raw)
    assert statuses == [429] and received == []


@pytest.mark.parametrize("host", [b"Elsewhere", b"elsewhere.", b"ELSEWHERE.:80", b"elsewhere:80"])
def test_a_host_route_matches_the_canonical_host(
        host: bytes, gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    raw = req("GET", "/hosted/x").replace(b"Host: gw", b"Host: " + host)
    statuses, received, _ = run_case(gateway, logging_upstream, raw)
    assert statuses == [200]
    assert len(received) == 1 and b"\r\nx-forwarded-host: elsewhere\r\n" in received[0].head


def test_an_absolute_form_target_with_a_trailing_dot_matches_the_host_route(
        gateway: Deployed, logging_upstream: LoggingUpstream) -> None:
    statuses, received, _ = run_case(gateway, logging_upstream, req("GET", "http://elsewhere./hosted/abs"))
    if gateway.server == "uvicorn":  # its protocol routes by the Host field, as in absolute-form-routes-by-authority
        assert statuses == [404] and received == []
        return
    assert statuses == [200] and len(received) == 1
