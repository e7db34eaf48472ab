"""Differential: what the gateway counts is what each origin's application reads.

Three real origins on different parsers and frameworks (uvicorn + h11 and uvicorn + httptools under
Starlette, aiohttp's own server) stand behind one gateway. For generated requests (whitespace
around values, field-name case, duplicate fields, percent-encodings and separators in the query and
cookies, host case, trailing dots and default ports, the body framed by Content-Length or by
chunks) each origin answers with what its application read: X-User-Id, the query's `id`, the
cookie `sid`, the host (X-Forwarded-Host, as the gateway rewrote Host), the body. Every rule
admits one request per identity. A request is either refused by the gateway (400, nothing
forwarded), or every origin reads the same values, and then the plainest request carrying each
value an origin read (no whitespace, no encoding, Content-Length) is refused by that value's rule:
the variant and the plain form were counted as one. A gateway that keyed on raw bytes (trailing
whitespace, `A.Example.`, a chunked body, `sid=s%54` for an upstream that decodes cookies) fails
here. The gateway may count two values an origin tells apart as one (it decodes cookie escapes,
as Express does, where Starlette does not): stricter, never a way past a limit.

Issue 33's classes have generators of their own: numbers in a typed path parameter (`{item:int}`,
read by each origin as Python's int() reads it, as FastAPI does: 042, +42, 4_2, 42.0, digits of
other scripts, percent-encoded), backslash and octal escapes in quoted cookies, query values
outside Latin-1 and invalid UTF-8, and the path in another case (no route takes it: a 404, nothing
forwarded). Round three adds numbers in every typed source (query, header, cookie) and the method
each origin acts on: HEAD by its GET handler, and method-override fields as a framework honouring
them reads them (a POST naming GET where POST has its own limited route was counted as GET before,
and ran the POST handler of every origin here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.raw_http import Conn
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_for_port

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

ORIGINS = ("h11", "httptools", "aiohttp")
FIELDS = ("user", "id", "sid", "host", "body", "item")
LIMIT = 1

RULES = "\n".join(
    f"      - {{{{name: {name}, by: [\"{source}\"], algorithm: fixed_window, limit: {LIMIT}, window: 1h, "
    "on_missing: skip}}"
    for name, source in (("user", "header:X-User-Id"), ("id", "query:id"), ("sid", "cookie:sid"),
                         ("host", "header:Host"), ("body", "body")))
ROUTE = """
  - name: n-{kind}
    match: {{{{path: "/n-{kind}/{{{{item:int}}}}"}}}}
    upstream: {kind}
    limits:
      - {{{{name: item, by: ["path:item"], algorithm: fixed_window, limit: 1, window: 1h}}}}
  - name: o-{kind}
    match: {{{{path: "/o-{kind}/{{{{rest:path}}}}"}}}}
    upstream: {kind}
    limits:
""" + RULES
ROUTE += """
  - name: t-{kind}
    match: {{{{path: "/t-{kind}/x"}}}}
    upstream: {kind}
    limits:
""" + "\n".join(
    f"      - {{{{{{{{name: {name}, by: [\"{source}\"], algorithm: fixed_window, limit: 1, window: 1h, "
    "on_missing: skip}}}}"
    for name, source in (("q_item", "query:item:int"), ("h_item", "header:X-Item:int"), ("c_item", "cookie:item:int")))
ROUTE += "".join(f"""
  - name: m-{method.lower()}-{{kind}}
    match: {{{{{{{{path: "/m-{{kind}}/x", methods: [{method}]}}}}}}}}
    upstream: {{kind}}
    limits: [{{{{{{{{name: {method.lower()}, by: [header:X-Client], algorithm: fixed_window, limit: 1,
              window: 1h}}}}}}}}]"""
                 for method in ("GET", "POST", "DELETE"))
CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
upstreams:
{upstreams}
routes:
{routes}
"""


@dataclass
class Origins:
    ports: dict[str, int]
    processes: list[subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def origins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origins]:
    root = Path(__file__).resolve().parents[2]
    log = (tmp_path_factory.mktemp("origins") / "origins.log").open("ab")
    ports, processes = {}, []
    try:
        for kind in ORIGINS:
            ports[kind] = free_port()
            processes.append(started([sys.executable, "-m", "tests.conformance.origins", kind,
                                               str(ports[kind])], cwd=root, stdout=log, stderr=log))
            wait_for_port(ports[kind], processes[-1])
        yield Origins(ports, processes)
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
        log.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess,
            origins: Origins) -> Iterator[GatewayProcess]:
    upstreams = "\n".join(f"  {kind}: {{url: \"http://127.0.0.1:{port}\", timeout: 5s}}"
                          for kind, port in origins.ports.items())
    routes = "\n".join(ROUTE.format(kind=kind) for kind in ORIGINS)
    text = CONFIG.format(prefix=f"d{uuid.uuid4().hex[:8]}", upstreams=upstreams, routes=routes)
    proc = GatewayProcess(text.replace("{{", "{").replace("}}", "}"), tmp_path_factory.mktemp("differential"),
                          redis_url=redis_proc.url)
    proc.start()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log(), proc.log()


# --- generated requests: T is a fresh token per example, Q the same token percent-encoded ------

ws = st.text(alphabet=" \t", max_size=2)
name_case = st.sampled_from(["X-User-Id", "x-user-id", "X-USER-ID", "x-User-ID"])
user_line = st.tuples(name_case, ws, ws).map(lambda p: f"{p[0]}:{p[1]}uT{p[2]}")
users: st.SearchStrategy[list[str]] = st.one_of(
    st.just([]), user_line.map(lambda line: [line]), st.lists(user_line, min_size=2, max_size=2))
query_values = st.sampled_from(["iT", "iQ", "iT%20", "iT+", "%69T", "iT;id=x", "iT%3Bx", "iT,x",
                                "i%E4%B8%ADT", "iT%FF", "%C3%A9T", "iT%ED%A0%80", "i%F0%9F%98%80T"])
queries = st.one_of(
    st.just(""),
    query_values.map(lambda v: f"id={v}"),
    st.tuples(query_values, query_values).map(lambda p: f"id={p[0]}&id={p[1]}"),
    query_values.map(lambda v: f"a=1;id={v}"),
)
cookie_values = st.sampled_from(['sT', '"sT"', "sQ", "sT%20", " sT ", "sT, sid=x", "sT; sid=x", "sT;x=1",
                                 '"\\sT"', '"\\163T"', '"s\\T"', '"sT\\""', '"\\x73T"', '"s\\005T"'])
cookies: st.SearchStrategy[list[str]] = st.one_of(
    st.just([]), cookie_values.map(lambda v: [f"Cookie: a=1; sid={v}"]),
    st.tuples(cookie_values, cookie_values).map(lambda p: [f"Cookie: sid={p[0]}", f"Cookie: sid={p[1]}"]))
hosts = st.tuples(st.sampled_from(["hT.example", "HT.Example", "hT.EXAMPLE"]), st.sampled_from(["", "."]),
                  st.sampled_from(["", ":80", ":8080"])).map(lambda p: p[0] + p[1] + p[2])
bodies = st.tuples(st.binary(max_size=40), st.booleans(), st.lists(st.integers(1, 16), max_size=4))


@dataclass(frozen=True)
class Sent:
    lines: list[str]
    query: str
    host: str
    body: tuple[bytes, bool, list[int]]
    upper: bool = False  # the path in upper case

    def raw(self, path: str, token: str) -> bytes:
        path = path.upper() if self.upper else path
        encoded = "".join(f"%{ord(c):02X}" for c in token)

        def fill(text: str) -> str:
            return text.replace("T", token).replace("Q", encoded)

        content, chunked, cuts = self.body
        content = b"b" + token.encode() + content
        target = path + ("?" + fill(self.query) if self.query else "")
        head = [f"POST {target} HTTP/1.1", f"Host: {fill(self.host)}", *(fill(line) for line in self.lines)]
        if not chunked:
            head.append(f"Content-Length: {len(content)}")
            return ("\r\n".join(head) + "\r\n\r\n").encode() + content
        head.append("Transfer-Encoding: chunked")
        pieces, at = [], 0
        for cut in [*cuts, len(content)]:
            piece, at = content[at:at + cut], at + cut
            if piece:
                pieces.append(b"%x\r\n%b\r\n" % (len(piece), piece))
        return ("\r\n".join(head) + "\r\n\r\n").encode() + b"".join(pieces) + b"0\r\n\r\n"


sent_requests = st.builds(lambda u, q, c, h, b, up: Sent([*u, *c], q, h, b, up), users, queries, cookies, hosts,
                          bodies, st.sampled_from([False] * 7 + [True]))

ARABIC_INDIC = str.maketrans("0123456789", "".join(chr(0x660 + d) for d in range(10)))
FULLWIDTH = str.maketrans("0123456789", "".join(chr(0xFF10 + d) for d in range(10)))


def _percent(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


spellings = st.sampled_from([
    "{n}", "0{n}", "00{n}", "+{n}", "{n}.0", "{h}_{t}", " {n}", "{n} ", "%2B{n}", "%20{n}", "{n}%20",
    "P({n})", "P(0{n})", "A({n})", "F({n})", "P(A({n}))", "{n}e0", "0x{x}", "-{n}", "{n}/",
])


def _spell(template: str, n: int) -> str:
    text = str(n)
    spelled = template.format(n=text, h=text[:2], t=text[2:], x=f"{n:x}")
    for name, change in (("A", lambda s: s.translate(ARABIC_INDIC)), ("F", lambda s: s.translate(FULLWIDTH)),
                         ("P", _percent)):
        while f"{name}(" in spelled:
            start = spelled.index(f"{name}(")
            end = spelled.index(")", start)
            spelled = spelled[:start] + change(spelled[start + 2:end]) + spelled[end + 1:]
    return _percent(spelled) if not spelled.isascii() else spelled.replace(" ", "%20")


def _plain(path: str, field: str, value: str) -> bytes:
    """The plainest request carrying `value` where an origin read `field`; every other identity fresh."""
    fresh = uuid.uuid4().hex[:12]
    target, lines, body = path, [], b"p" + fresh.encode()
    host = f"p{fresh}.example"
    if field == "user":
        lines.append(f"X-User-Id: {value}")
    elif field == "id":
        target += "?id=" + quote(value, safe="")
    elif field == "sid":
        lines.append(f"Cookie: sid={_cookie_spelling(value)}")
    elif field == "host":
        host = value
    else:
        body = bytes.fromhex(value)
    head = [f"POST {target} HTTP/1.1", f"Host: {host}", *lines, f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _cookie_spelling(value: str) -> str:
    """The value as is when a cookie can carry it so; else quoted, each other character escaped
    (octal for a control character: `"s\\T"` with a token starting 005 is read as s, \\x05, ...)."""
    if all(0x20 < ord(c) < 0x7F and c not in '";,\\' for c in value):
        return value
    escaped = (c if 0x20 <= ord(c) < 0x7F and c not in '"\\' else "\\" + c if c in '"\\' else f"\\{ord(c):03o}"
               for c in value)
    return '"' + "".join(escaped) + '"'


def _exchange(port: int, raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    with Conn(port) as conn:
        conn.send(raw)
        status, headers, body = conn.response()
    return status, dict(headers), body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sent_requests)
@example(Sent(['Cookie: a=1; sid="s\\005T"'], "", "hT.example", (b"", False, [])))  # a control character
def test_the_value_every_origin_reads_is_what_the_gateway_counts(gateway: GatewayProcess, sent: Sent) -> None:
    token = uuid.uuid4().hex[:12]
    read: dict[str, dict[str, str | None]] = {}
    for kind in ORIGINS:
        path = f"/o-{kind}/x"
        status, headers, body = _exchange(gateway.port, sent.raw(path, token))
        if status == 400 or (status == 404 and sent.upper):  # refused as sent, or no route: nothing forwarded
            assert headers.get(b"content-type") == b"application/problem+json", body
            continue
        assert status == 200, (kind, status, body)
        read[kind] = json.loads(body)
        for field in FIELDS:
            value = read[kind][field]
            if not value:
                continue
            status, _, body = _exchange(gateway.port, _plain(path, field, value))
            assert status == 429 and json.loads(body)["rule"] == field, (kind, field, value, sent, status, body)
    for field in FIELDS:  # behind the gateway, the origins agree on every value
        assert len({answer[field] for answer in read.values()}) <= 1, (field, read, sent)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spellings)
def test_a_number_is_counted_as_the_number_every_origin_reads(gateway: GatewayProcess, template: str) -> None:
    """A typed path parameter: a spelling the gateway takes is the number each origin reads (and the
    plain digits of it are then refused); any other is a 400, or a 404 when it is no number at all."""
    n = 10**11 + uuid.uuid4().int % 10**11  # a fresh number per example
    spelled = _spell(template, n)
    for kind in ORIGINS:
        path = f"/n-{kind}/{spelled}"
        raw = f"POST {path} HTTP/1.1\r\nHost: a.example\r\nContent-Length: 0\r\n\r\n".encode()
        status, headers, body = _exchange(gateway.port, raw)
        if status in (400, 404):
            assert headers.get(b"content-type") == b"application/problem+json", body
            continue
        assert status == 200, (kind, spelled, status, body)
        item = json.loads(body)["item"]
        assert item == str(n), (kind, spelled, item)  # the gateway took only what reads as n
        plain = f"POST /n-{kind}/{item} HTTP/1.1\r\nHost: a.example\r\nContent-Length: 0\r\n\r\n".encode()
        status, _, body = _exchange(gateway.port, plain)
        assert status == 429 and json.loads(body)["rule"] == "item", (kind, spelled, status, body)


def test_origins_disagree_on_the_raw_bytes_so_the_test_has_teeth(origins: Origins) -> None:
    """Straight to the origins (no gateway), the same bytes read differently: trailing whitespace
    is kept by llhttp and dropped by h11 and aiohttp."""
    raw = b"GET /x HTTP/1.1\r\nHost: a\r\nX-User-Id: alice \t\r\n\r\n"
    seen = {}
    for kind, port in origins.ports.items():
        status, _, body = _exchange(port, raw)
        assert status == 200
        seen[kind] = json.loads(body)["user"]
    assert len(set(seen.values())) > 1, seen


# --- round three: a number in every typed source, and the method the origin acts on ------------

TYPED = {"q_item": "query", "h_item": "header", "c_item": "cookie"}


def _typed_request(path: str, source: str, spelled: str, raw_text: str) -> bytes:
    """`spelled` (percent-encoded) in the query, or the raw text in a header or cookie."""
    target, lines = path, []
    if source == "query":
        target += f"?item={spelled}"
    elif source == "header":
        lines.append(f"X-Item: {raw_text}")
    else:
        lines.append(f"Cookie: a=1; item={raw_text.replace(' ', '%20')}")
    head = [f"GET {target} HTTP/1.1", "Host: a.example", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spellings, st.sampled_from(sorted(TYPED)))
def test_a_number_in_any_typed_source_is_counted_as_the_number_every_origin_reads(
        gateway: GatewayProcess, template: str, field: str) -> None:
    """query:item:int, header:X-Item:int and cookie:item:int: a spelling the gateway forwards is
    counted as the number each origin's int() reads from it (the plain digits are then refused)."""
    source = TYPED[field]
    n = 10**11 + uuid.uuid4().int % 10**11
    spelled = _spell(template, n)
    raw_text = template.format(n=n, h=str(n)[:2], t=str(n)[2:], x=f"{n:x}")
    if "(" in raw_text:  # P(...), A(...), F(...): the decoded text, for a header or cookie
        raw_text = _spell(template, n).replace("%20", " ")
        raw_text = bytes.fromhex(raw_text.replace("%", "")).decode() if raw_text.startswith("%") else raw_text
    for kind in ORIGINS:
        path = f"/t-{kind}/x"
        status, headers, body = _exchange(gateway.port, _typed_request(path, source, spelled, raw_text))
        if status == 400:
            assert headers.get(b"content-type") == b"application/problem+json", body
            continue
        assert status == 200, (kind, source, spelled, status, body)
        read = json.loads(body)[field]
        if read is None:
            continue  # the origin read no number: nothing it acts on went uncounted
        status, _, body = _exchange(gateway.port, _typed_request(path, source, read, read))
        assert status == 429 and json.loads(body)["rule"] == field, (kind, source, spelled, read, status, body)


LINE_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE")
override_lines = st.lists(st.tuples(
    st.sampled_from(["X-HTTP-Method-Override", "x-http-method", "X-Method-Override", "X_HTTP_Method_Override"]),
    st.sampled_from(["GET", "get", "DELETE", " delete ", "HEAD", "POST", "PUT", "G E T", ""])), max_size=2)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(LINE_METHODS), override_lines)
@example("HEAD", [])
@example("POST", [("X-HTTP-Method-Override", "GET")])
def test_the_method_every_origin_acts_on_is_the_method_counted(gateway: GatewayProcess, method: str,
                                                               overrides: list[tuple[str, str]]) -> None:
    """GET, POST and DELETE each own /m-KIND/x with a limit of one per client. Each origin says the
    method its handler ran as (HEAD by the GET handler) and the one a framework honouring
    method-override fields would run (Express's method-override, Symfony): whatever the gateway
    forwarded, a plain request of either method by the same client is refused (429), or is no
    method the gateway takes there at all (405)."""
    for kind in ORIGINS:
        client = uuid.uuid4().hex[:12]
        head = [f"{method} /m-{kind}/x HTTP/1.1", "Host: a.example", f"X-Client: {client}",
                *(f"{name}: {value}" for name, value in overrides), "Content-Length: 0"]
        with Conn(gateway.port) as conn:
            conn.send(("\r\n".join(head) + "\r\n\r\n").encode())
            status, headers, body = conn.response(head_only=method == "HEAD")
        if status in (400, 405):
            continue  # refused as sent: nothing forwarded
        assert status == 200, (kind, method, overrides, status, body)
        read = json.loads(headers[b"x-read"])
        for acted in {read["method"], read["overridden"]}:
            plain = f"{acted} /m-{kind}/x HTTP/1.1\r\nHost: a\r\nX-Client: {client}\r\nContent-Length: 0\r\n\r\n"
            status, _, body = _exchange(gateway.port, plain.encode())
            assert status in (429, 405), (kind, method, overrides, acted, status, body)
            if status == 429:
                assert json.loads(body)["rule"] == acted.lower(), (kind, method, overrides, acted, body)
