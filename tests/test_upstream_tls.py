"""TLS upstreams through a real gateway process: `http2: true` reaches a real HTTP/2 server
(hypercorn, ALPN h2) through httpx's transport, `tls:` with a client certificate passes a server
that requires one (mutual TLS, the lean transport over TLS), and a certificate the gateway cannot
verify, or a missing client certificate, is a 502 — never a plain-text fallback."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_for_port


class Hypercorn:
    def __init__(self, certs: dict[str, Path], require_client_cert: bool) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "hypercorn", "tests.support.tls_upstream:app", "--bind", f"127.0.0.1:{self.port}",
                "--certfile", str(certs["server_cert"]), "--keyfile", str(certs["server_key"])]
        if require_client_cert:
            args += ["--ca-certs", str(certs["ca"]), "--verify-mode", "CERT_REQUIRED"]
        self.process = started(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.process)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gateway.example")
    paths = {name: folder / f"{name}.pem" for name in ("ca", "server_cert", "server_key", "client_cert", "client_key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["server_cert"]))
    server.private_key_pem.write_to_path(str(paths["server_key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    return paths


@pytest.fixture(scope="module")
def gateway(certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
            redis_proc: RedisProcess) -> Iterator[GatewayProcess]:
    h2 = Hypercorn(certs, require_client_cert=False)
    mtls = Hypercorn(certs, require_client_cert=True)
    ca, cert, key = certs["ca"], certs["client_cert"], certs["client_key"]
    config = f"""
    version: 1
    redis: {{timeout: 500ms, key_prefix: t{uuid.uuid4().hex[:8]}}}
    upstreams:
      h2: {{url: "https://127.0.0.1:{h2.port}", http2: true, tls: {{ca: "{ca}"}}}}
      mtls: {{url: "https://127.0.0.1:{mtls.port}", tls: {{ca: "{ca}", cert: "{cert}", key: "{key}"}}}}
      nocert: {{url: "https://127.0.0.1:{mtls.port}", tls: {{ca: "{ca}"}}}}
      untrusted: {{url: "https://127.0.0.1:{h2.port}", http2: true}}
      unverified: {{url: "https://127.0.0.1:{h2.port}", tls: {{verify: false}}}}
    routes:
      - {{name: h2, match: {{path: "/h2/{{rest:path}}"}}, upstream: h2,
          limits: [{{name: per-user, by: ["header:X-User"], algorithm: token_bucket, rate: 100/s, burst: 100}}]}}
      - {{name: mtls, match: {{path: "/mtls/{{rest:path}}"}}, upstream: mtls}}
      - {{name: nocert, match: {{path: "/nocert/{{rest:path}}"}}, upstream: nocert}}
      - {{name: untrusted, match: {{path: "/untrusted/{{rest:path}}"}}, upstream: untrusted}}
      - {{name: unverified, match: {{path: "/unverified/{{rest:path}}"}}, upstream: unverified}}
    """
    proc = GatewayProcess(config, tmp_path_factory.mktemp("gw-tls"), redis_url=redis_proc.url)
    proc.start()
    yield proc
    assert proc.stop() == 0
    h2.stop()
    mtls.stop()


def test_http2_upstream_is_reached_over_http2_with_limits_applied(gateway: GatewayProcess) -> None:
    body = b"x" * 300_000
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        response = client.post("/h2/upload?a=1", content=body, headers={"X-User": "alice"})
        assert response.status_code == 200, response.text
        seen = response.json()
        assert seen["http_version"] == "2"
        assert (seen["path"], seen["query"], seen["length"]) == ("/h2/upload", "a=1", len(body))
        names = [name for name, _ in seen["headers"]]
        assert "x-forwarded-for" in names and "transfer-encoding" not in names
        assert response.headers["ratelimit-policy"] == '"per-user";q=100;w=1'
        streamed = client.post("/h2/chunked", content=iter([body[:1000], body[1000:]]), headers={"X-User": "a"})
        assert streamed.status_code == 200 and streamed.json()["length"] == len(body)
        assert client.get("/h2/x").status_code == 400  # the limit's identity is still required


def test_mutual_tls_presents_the_client_certificate(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for _ in range(3):  # and the TLS connection is kept alive and reused
            response = client.get("/mtls/hello")
            assert response.status_code == 200, response.text
            assert response.json()["http_version"] == "1.1"
        digest = hashlib.sha256(b"payload").hexdigest()
        assert client.post("/mtls/p", content=b"payload").json()["length"] == len(b"payload")
        assert digest  # the body arrived whole over TLS


def test_a_missing_client_certificate_or_an_untrusted_server_is_a_502(gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for path in ("/nocert/a", "/untrusted/a"):
            response = client.get(path)
            assert response.status_code == 502, (path, response.text)
            assert response.headers["content-type"] == "application/problem+json"
        unverified = client.get("/unverified/a")  # verify: false is the operator's explicit choice
        assert unverified.status_code == 200 and json.loads(unverified.text)["http_version"] == "1.1"


def test_tls_files_openssl_cannot_read_are_refused_with_their_line(certs: dict[str, Path], tmp_path: Path) -> None:
    """Before, `gateway check` passed a CA that is not PEM (or a certificate and a key of two
    pairs), and the first request to the upstream never got its answer (an outside probe)."""
    from gateway.config import load_config
    from gateway.errors import ConfigError

    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    for tls, key in [(f"{{ca: '{not_pem}'}}", "upstreams.up.tls.ca"),
                     (f"{{cert: '{certs['client_cert']}', key: '{certs['server_key']}'}}", "upstreams.up.tls.cert")]:
        path = tmp_path / "routes.yaml"
        path.write_text(f"version: 1\nupstreams:\n  up:\n    url: https://127.0.0.1:8443\n    tls: {tls}\n"
                        "routes:\n  - {name: a, match: {path: /a}, upstream: up}\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path, env={})
        assert [(p.line, p.key) for p in caught.value.problems] == [(5, key)], caught.value
        assert "OpenSSL" in caught.value.problems[0].message
