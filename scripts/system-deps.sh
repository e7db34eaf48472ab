#!/usr/bin/env bash
# Installs the Debian packages the tests and benchmark use, when they are missing and we may.
set -euo pipefail
need=()
command -v faketime >/dev/null || need+=(faketime)
[ -x /usr/bin/redis-server ] || need+=(redis-server)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v caddy >/dev/null || [ -x /usr/bin/caddy ] || need+=(caddy)  # forward_auth recipe tests
command -v wrk >/dev/null || need+=(wrk)
command -v h2load >/dev/null || need+=(nghttp2-client)  # bench/rls.py: gRPC load (h2load)
command -v promtool >/dev/null || need+=(prometheus)  # promtool tests the chart's alert rules
command -v chromium >/dev/null || need+=(chromium)  # the console's browser tests (tests/test_console.py)
command -v chromedriver >/dev/null || need+=(chromium-driver)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "system-deps: missing ${need[*]}; install them (Debian: apt-get install ${need[*]})" >&2
  exit 1
fi
echo "system-deps: installing ${need[*]}"
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's redis-server package starts a system service; the tests run their own.
(service redis-server stop || true) >/dev/null 2>&1
(service nginx stop || true) >/dev/null 2>&1
(service caddy stop || true) >/dev/null 2>&1
(service prometheus stop || true) >/dev/null 2>&1
