"""Identity sources: trusted proxies, JWT verification, query, cookie, body digest, on_missing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import Config, JwtSettings, RedisSettings, Rule, Source
from gateway.errors import BadRequest, IdentityMissing
from gateway.http.request import read_request
from gateway.identity import NOT_BEFORE_LEEWAY, JwtVerifier, RequestView, client_ip, rule_identity

TRUSTED = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("127.0.0.1/32"))


def test_xff_is_ignored_from_an_untrusted_peer() -> None:
    assert client_ip("203.0.113.5", b"1.2.3.4", TRUSTED) == "203.0.113.5"
    assert client_ip("203.0.113.5", None, TRUSTED) == "203.0.113.5"


def test_xff_from_a_trusted_proxy_gives_the_rightmost_untrusted_hop() -> None:
    assert client_ip("10.0.0.2", b"198.51.100.7", TRUSTED) == "198.51.100.7"
    # the client may prepend anything; only what our proxies appended counts
    assert client_ip("10.0.0.2", b"6.6.6.6, 198.51.100.7, 10.0.0.9", TRUSTED) == "198.51.100.7"
    # all trusted: the left-most address
    assert client_ip("10.0.0.2", b"10.1.1.1, 10.0.0.9", TRUSTED) == "10.1.1.1"


def test_garbage_in_xff_is_never_believed() -> None:
    assert client_ip("10.0.0.2", b"not-an-ip", TRUSTED) == "10.0.0.2"
    assert client_ip("10.0.0.2", b"6.6.6.6, bogus, 10.0.0.9", TRUSTED) == "10.0.0.9"
    assert client_ip("10.0.0.2", b"::1, 2001:db8::1", TRUSTED) == "2001:db8::1"


@given(st.lists(st.ip_addresses().map(str), min_size=1, max_size=6))
def test_client_ip_is_always_the_peer_or_an_address_from_the_chain(chain: list[str]) -> None:
    header = ", ".join(chain).encode()
    result = client_ip("10.0.0.2", header, TRUSTED)
    assert result in [str(ipaddress.ip_address(a)) for a in chain] + ["10.0.0.2"]
    assert client_ip("192.0.2.1", header, TRUSTED) == "192.0.2.1"


def _config(**jwt_settings: Any) -> Config:
    return Config(source="t", redis=RedisSettings(), trusted_proxies=TRUSTED, upstreams={}, routes=(),
                  jwt=JwtSettings(**jwt_settings), body_digest_max_bytes=16, identity_max_bytes=64)


def _view(config: Config, headers: list[tuple[bytes, bytes]], query: bytes = b"",
          params: dict[str, str] | None = None, verifier: JwtVerifier | None = None) -> RequestView:
    scope = {"headers": [(b"host", b"gw"), *headers], "query_string": query, "client": ("10.0.0.2", 1234),
             "method": "POST", "path": "/", "raw_path": b"/"}
    return RequestView(read_request(scope), params or {}, config, verifier)


def _unsigned(claims: dict[str, Any]) -> bytes:
    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    return b"Bearer " + b64(json.dumps({"alg": "none"}).encode()) + b"." + b64(json.dumps(claims).encode()) + b"."


def test_jwt_hs256_verified_claims_only() -> None:
    settings = JwtSettings(algorithms=("HS256",), secret="k" * 32)
    verifier = JwtVerifier(settings)
    good = b"Bearer " + jwt.encode({"sub": "alice", "tier": 3}, "k" * 32, algorithm="HS256").encode()
    assert verifier.claims(good) == {"sub": "alice", "tier": 3}
    assert verifier.claims(good) == {"sub": "alice", "tier": 3}  # cached
    assert verifier.claims(_unsigned({"sub": "mallory"})) is None
    wrong = b"Bearer " + jwt.encode({"sub": "mallory"}, "x" * 32, algorithm="HS256").encode()
    assert verifier.claims(wrong) is None
    expired = jwt.encode({"sub": "old", "exp": int(time.time()) - 10}, "k" * 32, algorithm="HS256")
    assert verifier.claims(b"Bearer " + expired.encode()) is None
    assert verifier.claims(b"Bearer " + b"x" * 10000) is None
    assert verifier.claims(None) is None


def test_jwt_rs256_with_a_public_key_and_no_algorithm_confusion() -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    verifier = JwtVerifier(JwtSettings(algorithms=("RS256",), public_key=public_pem, audience="shop"))
    token = jwt.encode({"sub": "bob", "aud": "shop"}, private, algorithm="RS256")
    assert verifier.claims(b"Bearer " + token.encode()) == {"sub": "bob", "aud": "shop"}
    other_aud = jwt.encode({"sub": "bob", "aud": "bank"}, private, algorithm="RS256")
    assert verifier.claims(b"Bearer " + other_aud.encode()) is None
    # HS256 signed with the public key text must not pass as RS256 (the classic confusion)
    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + b"." + b64(
        json.dumps({"sub": "eve", "aud": "shop"}).encode())
    signature = hmac.new(public_pem.encode(), signing_input, hashlib.sha256).digest()
    assert verifier.claims(b"Bearer " + signing_input + b"." + b64(signature)) is None


def test_sources_read_from_the_request() -> None:
    config = _config()
    view = _view(config, [(b"x-user", b"alice"), (b"cookie", b"a=1; sid=\"s-9\"; b"), (b"content-length", b"5")],
                 query=b"k=v%20w&other=second&empty=", params={"item": "42"})
    view.body_prefix = b"hello"
    assert view.read(Source("header", "x-user")) == b"alice"
    assert view.read(Source("query", "k")) == b"v w"
    assert view.read(Source("query", "empty")) == b""
    assert view.read(Source("cookie", "sid")) == b"s-9"
    assert view.read(Source("cookie", "b")) is None
    assert view.read(Source("path", "item")) == b"42"
    assert view.read(Source("method")) == b"POST"
    assert view.read(Source("ip")) == b"10.0.0.2"


def test_a_value_an_upstream_could_read_differently_is_a_400() -> None:
    config = _config()
    ambiguous = [
        ((), b"user=alice&user=bob", Source("query", "user")),           # PHP reads the last one
        ((), b"&".join([b"junk=1"] * 256) + b"&user=bob", Source("query", "user")),  # hidden past the cap
        (((b"cookie", b"sid=a; sid=b"),), b"", Source("cookie", "sid")),
        (((b"x-user", b"alice"), (b"x_user", b"bob")), b"", Source("header", "x-user")),  # HTTP_X_USER
        (((b"x_user", b"bob"),), b"", Source("header", "x-user")),
        (((b"x-request-id", b"a"), (b"x-request-id", b"b")), b"", Source("header", "x-request-id")),
        (((b"host", b"gw2"),), b"", Source("header", "host")),  # a second Host
    ]
    for headers, query, source in ambiguous:
        with pytest.raises(BadRequest):
            _view(config, list(headers), query=query).read(source)
    plain = _view(config, [(b"x-user", b"alice")], query=b"user=alice&other=1&other=2")
    assert plain.read(Source("query", "user")) == b"alice"  # another name repeated is no one's business
    assert plain.read(Source("header", "host")) == b"gw"    # Host, parsed once, is readable
    once = _view(config, [(b"x-request-id", b"r1")])
    assert once.read(Source("header", "x-request-id")) == b"r1"


def test_body_digest_is_the_bodys_bytes_whatever_the_framing() -> None:
    config = _config()  # body_digest_max_bytes: 16

    def digest(headers: list[tuple[bytes, bytes]], body: bytes, more: bool = False) -> bytes | None:
        view = _view(config, headers)
        view.body_prefix, view.body_more = body, more
        return view.read(Source("body"))

    short = b"order=42&qty=1"
    by_length = digest([(b"content-length", b"%d" % len(short))], short)
    assert by_length == digest([(b"transfer-encoding", b"chunked")], short)  # the same order, sent chunked
    assert by_length != digest([(b"content-length", b"15")], short + b"2")  # another body
    assert digest([], b"0123456789abcde") != digest([], b"0123456789abcde ")  # lengths within the bound differ
    # past the bound only the first 16 bytes count, whether the rest was read or is still coming
    long_a = digest([(b"content-length", b"40")], b"0123456789abcdef-and-more-beyond-the-bound")
    assert long_a == digest([(b"transfer-encoding", b"chunked")], b"0123456789abcdef-", more=True)
    assert long_a == digest([(b"content-length", b"41")], b"0123456789abcdef-something-else-entirely!!")
    assert long_a != by_length


def test_on_missing_reject_skip_ip_and_length_bound() -> None:
    config = _config()
    view = _view(config, [(b"x-long", b"z" * 65)])
    reject = Rule("r", (Source("header", "x-user"),), "quota", limit=1)
    with pytest.raises(IdentityMissing):
        rule_identity(reject, view)
    skip = Rule("s", (Source("header", "x-user"),), "quota", limit=1, on_missing="skip")
    assert rule_identity(skip, view) is None
    fallback = Rule("f", (Source("header", "x-user"),), "quota", limit=1, on_missing="ip")
    assert rule_identity(fallback, view) == (b"", b"10.0.0.2")
    too_long = Rule("l", (Source("header", "x-long"),), "quota", limit=1)
    with pytest.raises(BadRequest):
        rule_identity(too_long, view)


def test_a_jwt_not_valid_yet_is_no_permanent_no() -> None:
    """Issued by an IdP whose clock runs ahead: `iat`/`nbf` a little in the future is within the
    leeway for not-before (NOT_BEFORE_LEEWAY, 30 s); further ahead it is refused now and verified
    again once it may be valid, not held refused until a reload (issue 17, V4)."""
    verifier = JwtVerifier(JwtSettings(algorithms=("HS256",), secret="k" * 32))
    now = int(time.time())
    skewed = b"Bearer " + jwt.encode({"sub": "early", "iat": now + 2, "nbf": now + 2}, "k" * 32,
                                     algorithm="HS256").encode()
    assert verifier.claims(skewed) == {"sub": "early", "iat": now + 2, "nbf": now + 2}
    ahead = now + int(NOT_BEFORE_LEEWAY) + 1  # valid in a second or two, not now
    later = b"Bearer " + jwt.encode({"sub": "later", "nbf": ahead}, "k" * 32, algorithm="HS256").encode()
    assert verifier.claims(later) is None
    assert verifier.claims(later) is None  # the cached no, while it holds
    deadline = time.monotonic() + 5
    while verifier.claims(later) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert verifier.claims(later) == {"sub": "later", "nbf": ahead}


def test_a_cached_jwt_yes_ends_with_its_exp() -> None:
    verifier = JwtVerifier(JwtSettings(algorithms=("HS256",), secret="k" * 32))
    exp = int(time.time()) + 1
    token = b"Bearer " + jwt.encode({"sub": "brief", "exp": exp}, "k" * 32, algorithm="HS256").encode()
    assert verifier.claims(token) == {"sub": "brief", "exp": exp}
    while time.time() < exp + 0.05:
        time.sleep(0.05)
    assert verifier.claims(token) is None
    # the not-before leeway never stretches an expiry
    late = b"Bearer " + jwt.encode({"sub": "late", "iat": int(time.time()) + 5, "exp": int(time.time()) - 1},
                                   "k" * 32, algorithm="HS256").encode()
    assert verifier.claims(late) is None
