"""What ships: the Dockerfile, the Helm chart and the wheel, checked with the real tools, offline.

- hadolint lints the Dockerfile; every `# hadolint ignore=` carries a reason and hides nothing else.
- The chart is linted (--strict) and rendered by Helm's own Go SDK (helm-python-sdk, no helm binary,
  no cluster) for several sets of values; every manifest is validated by kubernetes-validate in strict
  mode for the oldest Kubernetes the chart supports and the newest the validator knows. ServiceMonitor
  is a CRD the validator has no schema for: it is checked against a small schema written here.
- The routes.yaml each rendering puts in its ConfigMap passes `gateway check`, in the pod's environment.
- Values that cannot work are refused with a message that says what to change.
- The wheel is built from exactly what the Dockerfile copies, holds the Lua script, and installs into a
  fresh venv where the image's entry command (`gateway serve`) and its HEALTHCHECK run as in the image.

No Docker engine is needed or used: `docker build` itself is not run here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import GatewayProcess
from tests.support.orphans import started
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "gateway"
DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent
HADOLINT = shutil.which("hadolint", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") or "hadolint"
RELEASE, NAMESPACE = "edge", "gateways"
FULLNAME = f"{RELEASE}-gateway"
ADMIN_SECRET = f"{FULLNAME}-admin-token"
# Admin endpoints that never depend on Redis (SPEC section 5; tests/test_operators.py holds them to it)
REDIS_INDEPENDENT = ("/healthz", "/readyz")

# The chart's floor (Chart.yaml kubeVersion) and the newest release kubernetes-validate knows.
KUBE_VERSIONS = ("1.25.0", kv.latest_version())


# --- Dockerfile -----------------------------------------------------------------------------------

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str, int]]:
    """(INSTRUCTION, arguments, line) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str, int]] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, rest = text.partition(" ")
        out.append((keyword.upper(), rest.strip(), start))
    return out


def stages() -> dict[str, list[tuple[str, str, int]]]:
    result: dict[str, list[tuple[str, str, int]]] = {}
    current: list[tuple[str, str, int]] | None = None
    for keyword, rest, line in dockerfile_instructions():
        if keyword == "FROM":
            name = rest.split()[-1] if " AS " in rest.upper() else str(len(result))
            current = result.setdefault(name, [])
        if current is not None:
            current.append((keyword, rest, line))
    return result


def instruction(stage: list[tuple[str, str, int]], keyword: str) -> list[str]:
    return [rest for kw, rest, _ in stage if kw == keyword]


def test_hadolint_is_clean() -> None:
    result = subprocess.run([HADOLINT, "--no-color", "-f", "json", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(result.stdout or "[]") == [], result.stdout + result.stderr
    assert result.returncode == 0


def test_every_hadolint_ignore_has_a_reason_and_hides_nothing_else() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    ignored: set[str] = set()
    for index, line in enumerate(lines):
        match = re.match(r"#\s*hadolint ignore=([A-Z0-9,]+)", line.strip())
        if match:
            ignored.update(match.group(1).split(","))
            above = lines[index - 1].strip() if index else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {index + 1}: say why above the ignore"
    result = subprocess.run([HADOLINT, "--no-color", "-f", "json", "--disable-ignore-pragma",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    found = {finding["code"] for finding in json.loads(result.stdout or "[]")}
    assert found == ignored, f"ignored {sorted(ignored)}, but without the pragmas hadolint reports {sorted(found)}"


def test_dockerfile_contract() -> None:
    by_stage = stages()
    assert list(by_stage) == ["builder", "runtime"], "a builder stage, then the runtime stage last"
    args = dict(a.split("=", 1) for a in instruction(dockerfile_instructions(), "ARG") if "=" in a)
    image = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", image), image
    froms = [rest for stage in by_stage.values() for rest in instruction(stage, "FROM")]
    assert all(rest.startswith("${PYTHON_IMAGE} AS ") for rest in froms), "both stages on the pinned base"

    runtime = by_stage["runtime"]
    run_lines = " ".join(instruction(runtime, "RUN"))
    for tool in ("apt-get", "pip", "gcc", "make", "curl"):
        assert tool not in run_lines, f"{tool} in the runtime stage"
    copies = instruction(runtime, "COPY")
    assert "--from=builder /opt/gateway /opt/gateway" in copies
    assert "routes.yaml /etc/gateway/routes.yaml" in copies
    assert instruction(runtime, "USER") == ["10001:10001"], "numeric non-root user (runAsNonRoot can check it)"
    assert instruction(runtime, "EXPOSE") == ["8080 9090"]
    env = " ".join(instruction(runtime, "ENV"))
    assert "GATEWAY_CONFIG=/etc/gateway/routes.yaml" in env
    assert "TMPDIR=/tmp" in env
    healthcheck = instruction(runtime, "HEALTHCHECK")
    assert len(healthcheck) == 1 and "CMD [\"python\"" in healthcheck[0]
    assert "127.0.0.1" in healthcheck[0] and "/healthz" in healthcheck[0] and "'9090'" in healthcheck[0]
    assert entry_command() == ["gateway", "serve"]
    assert "gateway serve" in (ROOT / "README.md").read_text()
    license_ = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert f'org.opencontainers.image.licenses="{license_}"' in " ".join(instruction(runtime, "LABEL"))
    with helm.Chart.load(CHART) as chart:
        assert chart.metadata["annotations"]["artifacthub.io/license"] == license_


def entry_command() -> list[str]:
    runtime = stages()["runtime"]
    entrypoint = json.loads(instruction(runtime, "ENTRYPOINT")[-1])
    cmd = json.loads(instruction(runtime, "CMD")[-1])
    return [*entrypoint, *cmd]


def healthcheck_command() -> list[str]:
    text = instruction(stages()["runtime"], "HEALTHCHECK")[-1]
    return list(json.loads(text[text.index("CMD") + 3:].strip()))


def runtime_env() -> dict[str, str]:
    """The runtime stage's ENV, as `KEY=value` pairs."""
    env: dict[str, str] = {}
    for rest in instruction(stages()["runtime"], "ENV"):
        for pair in shlex.split(rest):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def builder_sources() -> list[str]:
    """What the builder stage copies from the build context (not from other stages)."""
    sources: list[str] = []
    for rest in instruction(stages()["builder"], "COPY"):
        parts = [p for p in rest.split() if not p.startswith("--")]
        sources += parts[:-1]
    return sources


def dockerignore_excludes(path: str) -> bool:
    """Docker's rules: patterns in order, the last one matching the path or a parent wins."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_build_copies_and_nothing_else() -> None:
    needed = [*builder_sources(), "routes.yaml", "gateway/config/loader.py", "lua/decide.lua"]
    for path in needed:
        assert not dockerignore_excludes(path.rstrip("/")), f"{path} is needed by the build but ignored"
    for path in (".git/HEAD", ".venv/bin/python", "tests/test_deploy.py", "helm/gateway/Chart.yaml",
                 "bench/run.py", "gateway/__pycache__/cli.cpython-311.pyc", ".env"):
        assert dockerignore_excludes(path), f"{path} would be sent to the Docker daemon"


# --- Helm chart -----------------------------------------------------------------------------------

REPO_ROUTES = (ROOT / "routes.yaml").read_text()

RLS_ROUTES = """\
version: 1
redis: {mode: "${REDIS_MODE:-standalone}", timeout: 50ms}
admin: {token: "${ADMIN_TOKEN:-}"}
rls: {files: [rls/config.yaml]}
"""
RLS_FILE = """\
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 600}
"""


SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "production": {
        "redis": {"url": "redis://redis-master.data.svc:6379/0"},
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12,
                        "targetMemoryUtilizationPercentage": 80,
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}},
        "podDisruptionBudget": {"minAvailable": 2},
        "image": {"registry": "registry.example.com", "repository": "edge/ratelimit-gateway", "tag": "0.1.0",
                  "digest": "sha256:" + "ab" * 32},
        "workers": 2,
        "resources": {"requests": {"cpu": "2", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "extraEnv": [{"name": "BACKEND_URL", "value": "http://shop.shop.svc:8080"}],
        "service": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                    "loadBalancerSourceRanges": ["203.0.113.0/24"]},
        "commonAnnotations": {"team": "edge"},
    },
    "hpa-off-existing-secret": {
        "replicaCount": 3,
        "autoscaling": {"enabled": False},
        "redis": {"existingSecret": "redis-conn", "existingSecretKey": "url"},
        "admin": {"existingSecret": "gateway-admin"},
    },
    "cluster-redis": {
        "redis": {"existingSecret": "redis-cluster-conn", "mode": "cluster"},
        "autoscaling": {"enabled": True},
        "routes": REPO_ROUTES.replace("mode: standalone", "mode: ${REDIS_MODE:-standalone}"),
    },
    "sentinel-redis": {
        "redis": {"url": "redis://sentinel.data.svc:26379", "mode": "sentinel", "sentinelMaster": "primary"},
        "replicaCount": 2,
        "rollOnConfigChange": False,
        "updateStrategy": {"type": "Recreate"},
    },
    "monitoring-networkpolicy": {
        "redis": {"existingSecret": "redis-conn"},
        "replicaCount": 2,
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                           "relabelings": [{"action": "replace", "targetLabel": "tier", "replacement": "edge"}]},
        "networkPolicy": {
            "enabled": True,
            "proxyFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
            "adminFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "checkFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
            "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": 6379}, {"port": 8080}]}],
        },
        "check": {"enabled": True, "servicePort": 9191},
    },
    "repo-routes-as-mapping": {"routes": yaml.safe_load(REPO_ROUTES)},
    "envoy-rls-only": {  # a team moving from envoyproxy/ratelimit: its files, no route, TLS, Istio's Envoys
        "redis": {"existingSecret": "redis-conn"},
        "replicaCount": 3,
        "routes": RLS_ROUTES,
        "rls": {"enabled": True, "files": {"config.yaml": RLS_FILE}, "tls": {"secretName": "rls-tls"}},
        "networkPolicy": {
            "enabled": True,
            "proxyFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}],
            "adminFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "rlsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}],
            "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": 6379}]}],
        },
    },
    "dashboard-alerts-ingress": {
        "redis": {"existingSecret": "redis-conn"},
        "replicaCount": 2,
        "upstreams": {"backend": "http://shop.shop.svc:8080", "payments-api": "https://payments.example.net"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboard": {"enabled": True, "namespace": NAMESPACE, "annotations": {"grafana_folder": "Gateways"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                           "additionalRuleLabels": {"team": "edge"}},
        "ingress": {"enabled": True, "className": "nginx",
                    "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
                    "hosts": [{"host": "shop.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]},
                              {"host": "api.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"},
                                                                     {"path": "/health", "pathType": "Exact"}]}],
                    "tls": [{"secretName": "shop-tls", "hosts": ["shop.example.com", "api.example.com"]}]},
    },
}


def render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def manifests(values: dict[str, Any]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name, text in sorted(render(values).items()):
        if name.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str = FULLNAME) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    values = SCENARIOS[request.param]
    return request.param, values, manifests(values)


def test_helm_lint_strict_for_every_scenario() -> None:
    for name, values in SCENARIOS.items():
        for version in KUBE_VERSIONS:
            report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{version}")
            serious = [m for m in report["messages"] if m["severity"] >= 2]
            assert report["errors"] == [] and serious == [], f"{name} on {version}: {report}"


def test_the_chart_floor_is_the_version_validated() -> None:
    # Helm's lint does not compare kubeVersion with kube_version (install and template do), so the
    # floor declared in Chart.yaml is held to the oldest version every manifest is validated against.
    with helm.Chart.load(CHART) as chart:
        floor = chart.metadata["kubeVersion"]
    assert floor == f">={KUBE_VERSIONS[0]}-0"


SERVICE_MONITOR_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace", "labels"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"matchNames": {"type": "array", "items": {"type": "string"}},
                                                     "any": {"type": "boolean"}}},
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object",
                                                            "additionalProperties": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "relabelings": {"type": "array", "items": {"type": "object"}},
                        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                    }}},
            },
        },
    },
}


PROMETHEUS_RULE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name", "namespace", "labels"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                    "name": {"type": "string"},
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["alert", "expr"],
                        "properties": {
                            "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                            "expr": {"type": "string"},
                            "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                        }}}}}}}},
    },
}
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def test_every_manifest_validates_strictly(scenario: tuple[str, dict[str, Any], list[dict[str, Any]]]) -> None:
    name, _, docs = scenario
    assert docs
    for doc in docs:
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"]["namespace"] == NAMESPACE, where
        if doc["kind"] in CRD_SCHEMAS:
            # CRDs: kubernetes-validate has no schema for them (SchemaNotFoundError), so ours.
            jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).validate(doc)
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{where} on Kubernetes {version}: {path}: {exc.message}")


def pod_env(deployment: dict[str, Any]) -> dict[str, str]:
    """The container's environment; a secretKeyRef stands for a value the test makes up."""
    env: dict[str, str] = {}
    for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            made_up = f"from-secret-{ref['name']}-{ref['key']}"
            # a Redis URL is checked as one (gateway/urls.py): the made-up value is one
            env[item["name"]] = f"redis://{made_up}:6379" if item["name"] == "GATEWAY_REDIS_URL" else made_up
    return env


def test_rendered_routes_pass_gateway_check(scenario: tuple[str, dict[str, Any], list[dict[str, Any]]],
                                            tmp_path: Path) -> None:
    name, values, docs = scenario
    data = one(docs, "ConfigMap")["data"]
    routes = data["routes.yaml"]
    path = tmp_path / "routes.yaml"
    path.write_text(routes)
    items = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]["configMap"]["items"]
    for item in items:  # the pod's /etc/gateway, as the volume lays it out
        (tmp_path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / item["path"]).write_text(data[item["key"]])
    env = pod_env(one(docs, "Deployment"))
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "TZ")}
    result = subprocess.run([sys.executable, "-m", "gateway", "check", str(path)], cwd=ROOT,
                            env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{name}:\n{result.stderr}\n{routes}"
    assert "ok" in result.stdout

    from gateway.config import load_config

    config = load_config(path, env)
    assert config.redis.mode == values.get("redis", {}).get("mode", "standalone"), name
    assert config.admin_token == env["ADMIN_TOKEN"], "the token comes from a Secret, always"
    assert config.redis.url == "", "the URL never sits in the ConfigMap; GATEWAY_REDIS_URL carries it"


def test_pods_are_restricted_and_probed_on_the_admin_port(
    scenario: tuple[str, dict[str, Any], list[dict[str, Any]]]
) -> None:
    name, values, docs = scenario
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"]["cpu"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    checking = {"check": 8081} if values.get("check", {}).get("enabled") else {}
    checking |= {"grpc-rls": 8082} if values.get("rls", {}).get("enabled") else {}
    assert ports == {"proxy": 8080, "admin": 9090, **checking}
    # Probes only on endpoints that answer 200 while Redis is down (tests/test_operators.py kills
    # Redis under traffic and polls /readyz): a shared-Redis outage must not empty the Service.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in REDIS_INDEPENDENT, probe
        assert container[probe]["httpGet"]["port"] == "admin", probe
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["args"][0] == "serve"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "a writable /tmp for the embedded Redis and metrics"
    assert volumes[mounts["/etc/gateway"]]["configMap"]["name"] == FULLNAME
    env = pod_env(deployment)
    assert env["GATEWAY_CONFIG"] == "/etc/gateway/routes.yaml" and env["TMPDIR"] == "/tmp"
    assert env["GATEWAY_ADMIN_HOST"] == "0.0.0.0", "the kubelet and Prometheus reach the admin port"
    assert env["GATEWAY_WORKERS"] == str(values.get("workers", 1))
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > int(env["GATEWAY_DRAIN_TIMEOUT"]) + 5, "the kubelet waits for the drain"
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    assert ("checksum/config" in annotations) == values.get("rollOnConfigChange", True), name


def test_redis_url_reaches_the_pod_only_as_configured(
    scenario: tuple[str, dict[str, Any], list[dict[str, Any]]]
) -> None:
    _, values, docs = scenario
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    redis = values.get("redis", {})
    if redis.get("existingSecret"):
        assert env["GATEWAY_REDIS_URL"] == {"name": "GATEWAY_REDIS_URL", "valueFrom": {"secretKeyRef": {
            "name": redis["existingSecret"], "key": redis.get("existingSecretKey", "redis-url")}}}
    elif redis.get("url"):
        assert env["GATEWAY_REDIS_URL"]["value"] == redis["url"]
    else:
        assert "GATEWAY_REDIS_URL" not in env, "embedded Redis"
    assert env["REDIS_MODE"]["value"] == redis.get("mode", "standalone")
    admin = values.get("admin", {})
    ref = env["ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    if admin.get("existingSecret"):
        assert ref == {"name": admin["existingSecret"], "key": admin.get("existingSecretKey", "token")}
    else:
        assert ref == {"name": ADMIN_SECRET, "key": "token"}, "the chart's own token Secret"


def test_autoscaling_and_disruption_budget(scenario: tuple[str, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, values, docs = scenario
    deployment = one(docs, "Deployment")
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    if values.get("autoscaling", {}).get("enabled"):
        (hpa,) = hpas
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
        assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
        assert {m["resource"]["name"] for m in hpa["spec"]["metrics"]} >= {"cpu"}
    else:
        assert hpas == []
        assert deployment["spec"]["replicas"] == values.get("replicaCount", 1)
    strategy = values.get("updateStrategy", {}).get("type", "RollingUpdate")
    if strategy == "Recreate":
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "no rollingUpdate beside Recreate"
    else:
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert len(pdb["spec"]) == 2, "minAvailable or maxUnavailable, never both"


def test_services_keep_admin_apart(scenario: tuple[str, dict[str, Any], list[dict[str, Any]]]) -> None:
    _, values, docs = scenario
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    proxy, admin = one(docs, "Service"), one(docs, "Service", f"{FULLNAME}-admin")
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    if values.get("check", {}).get("enabled"):  # its own ClusterIP Service, never the proxy's
        check = one(docs, "Service", f"{FULLNAME}-check")
        assert check["spec"]["type"] == "ClusterIP" and check["spec"]["selector"] == selector
        assert [(p["targetPort"], p["port"]) for p in check["spec"]["ports"]] == [("check", 9191)]
        assert {"name": "check", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
        assert pod_env(one(docs, "Deployment"))["GATEWAY_CHECK_PORT"] == "8081"
    else:
        assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-check")]
        assert "GATEWAY_CHECK_PORT" not in pod_env(one(docs, "Deployment"))
    env = pod_env(one(docs, "Deployment"))
    if values.get("rls", {}).get("enabled"):  # gRPC for the meshes: HTTP/2 from the first byte
        rls = one(docs, "Service", f"{FULLNAME}-rls")
        assert rls["spec"]["type"] == "ClusterIP" and rls["spec"]["selector"] == selector
        assert [(p["name"], p["targetPort"], p["port"], p["appProtocol"]) for p in rls["spec"]["ports"]] == [
            ("grpc-rls", "grpc-rls", 8081, "grpc")]
        assert env["GATEWAY_RLS_PORT"] == "8082"
        if values["rls"].get("tls", {}).get("secretName"):
            volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
            assert volumes["rls-tls"]["secret"]["secretName"] == values["rls"]["tls"]["secretName"]
            assert env["GATEWAY_RLS_TLS_CERT"] == "/etc/gateway-rls-tls/tls.crt"
    else:
        assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-rls")]
        assert "GATEWAY_RLS_PORT" not in env
    assert [p["targetPort"] for p in proxy["spec"]["ports"]] == ["proxy"]
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    assert admin["spec"]["type"] == "ClusterIP"
    assert proxy["spec"]["selector"] == admin["spec"]["selector"] == selector
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    if values.get("serviceMonitor", {}).get("enabled"):
        (monitor,) = monitors
        match = monitor["spec"]["selector"]["matchLabels"]
        assert match.items() <= admin["metadata"]["labels"].items(), "it scrapes the admin Service"
        assert not match.items() <= proxy["metadata"]["labels"].items(), "and not the proxy Service"
        assert monitor["spec"]["endpoints"][0]["port"] == admin["spec"]["ports"][0]["name"]
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    else:
        assert monitors == []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if values.get("networkPolicy", {}).get("enabled"):
        (policy,) = policies
        rules = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
        assert rules["admin"]["from"] == values["networkPolicy"]["adminFrom"]
        assert rules["proxy"]["from"] == values["networkPolicy"]["proxyFrom"]
        if values.get("check", {}).get("enabled"):
            assert rules["check"]["from"] == values["networkPolicy"]["checkFrom"]
        else:
            assert "check" not in rules
        if values.get("rls", {}).get("enabled"):
            assert rules["grpc-rls"]["from"] == values["networkPolicy"]["rlsFrom"]
        else:
            assert "grpc-rls" not in rules
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert policy["spec"]["egress"][0]["ports"][0]["port"] == 53, "DNS stays allowed"
    else:
        assert policies == []


def test_checksum_follows_the_routes() -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(manifests(values), "Deployment")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    routes = render({})
    text = yaml.safe_load(routes["gateway/templates/configmap.yaml"])["data"]["routes.yaml"]
    assert checksum({}) == hashlib.sha256(text.encode()).hexdigest()
    assert checksum({}) == checksum({"replicaCount": 1, "logLevel": "debug"})
    assert checksum({}) != checksum({"routes": text.replace("limit: 600", "limit: 601")})


def test_notes_tell_how_to_reach_it() -> None:
    notes = render({})["gateway/templates/NOTES.txt"]
    assert f"service/{FULLNAME}-admin" in notes and "embedded Redis" in notes
    assert f"get secret {ADMIN_SECRET} -o jsonpath='{{.data.token}}'" in notes
    notes = render(SCENARIOS["hpa-off-existing-secret"])["gateway/templates/NOTES.txt"]
    assert "embedded Redis" not in notes and "get secret gateway-admin" in notes


def test_the_admin_token_secret() -> None:
    docs = manifests({})
    secret = one(docs, "Secret", ADMIN_SECRET)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token), "generated: 48 random characters"
    again = base64.b64decode(one(manifests({}), "Secret", ADMIN_SECRET)["data"]["token"]).decode()
    assert again != token, "without a cluster to look it up in, a render generates a new one"
    # Kept across upgrades: the template reads the release's Secret back with `lookup` before it
    # generates (a lookup needs a live cluster; these tests render offline, so this is read off the template).
    template = (CHART / "templates" / "secret-admin.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert template.index("lookup") < template.index("randAlphaNum")
    given = one(manifests({"admin": {"token": "from-values"}}), "Secret", ADMIN_SECRET)
    assert base64.b64decode(given["data"]["token"]) == b"from-values"
    theirs = manifests(SCENARIOS["hpa-off-existing-secret"])
    assert not [d for d in theirs if d["kind"] == "Secret"], "admin.existingSecret: the chart keeps none"


REFUSED = [
    ({"replicaCount": -1}, "/replicaCount"),
    ({"workers": 0}, "/workers"),
    ({"redis": {"mode": "primary-replica"}}, "/redis/mode"),
    ({"redis": {"url": "http://redis:6379"}}, "/redis/url"),
    ({"replicas": 3}, "'replicas' not allowed"),
    ({"redis": {"url": "redis://redis:6379", "existingSecret": "redis"}},
     "set redis.url or redis.existingSecret, not both"),
    ({"redis": {"url": "redis://:hunter2@redis:6379/0"}}, "redis.url: it holds a password"),
    ({"redis": {"url": "redis://default:hunter2@redis:6379"}}, "Put the whole URL in a Secret"),
    ({"redis": {"url": "rediss://redis:6380/0?password=hunter2"}}, "redis.url: it holds a password"),
    ({"replicaCount": 3}, "replicaCount 3 needs a shared Redis"),
    ({"autoscaling": {"enabled": True}}, "autoscaling.enabled needs a shared Redis"),
    ({"redis": {"mode": "cluster"}}, "redis.mode: cluster needs redis.url or redis.existingSecret"),
    ({"redis": {"url": "redis://r:6379"}, "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
     "minReplicas (5) is larger than maxReplicas (2)"),
    ({"containerPorts": {"proxy": 9090, "admin": 9090}}, "proxy and admin must differ"),
    ({"terminationGracePeriodSeconds": 10}, "terminationGracePeriodSeconds (10) must be longer"),
    ({"routes": "version: 1\nroutes: [\n"}, "routes: not a YAML mapping"),
    ({"routes": REPO_ROUTES.replace("${REDIS_URL:-}", "redis://:pw@redis:6379")},
     "redis.url is written in routes.yaml"),
    ({"routes": REPO_ROUTES.replace("${ADMIN_TOKEN:-}", "s3cret")}, "admin.token is a literal token"),
    ({"routes": REPO_ROUTES, "redis": {"url": "redis://r:6379", "mode": "cluster"}},
     'redis.mode is "standalone" but the chart\'s redis.mode is "cluster"'),
    ({"admin": {"existingSecret": "adm"}, "routes": REPO_ROUTES.replace("${ADMIN_TOKEN:-}", "")},
     "admin.existingSecret is set but routes does not read it"),
    ({"routes": REPO_ROUTES.replace("${ADMIN_TOKEN:-}", "")},
     "the chart passes the admin token as ADMIN_TOKEN but routes does not read it"),
    ({"admin": {"existingSecret": "adm", "token": "x"}}, "set admin.token or admin.existingSecret, not both"),
    ({"routes": REPO_ROUTES.replace("${SHOP_URL:-http://127.0.0.1:9000}", "${UPSTREAM_SHOP_API}")},
     "routes reads ${UPSTREAM_SHOP_API}, which no value sets: add `upstreams: {shop-api: URL}`"),
    ({"upstreams": {"shop": "shop.svc:8080"}}, "/upstreams/shop"),
    ({"ingress": {"enabled": True, "hosts": [{"host": "a.example.com", "paths": [{"path": "v1"}]}]}},
     "/ingress/hosts/0/paths/0/path"),
    ({"rls": {"enabled": True, "containerPort": 8080}}, "rls.containerPort: each port must differ"),
    ({"rls": {"files": {"a.yaml": "domain: a"}}}, "rls.files: they are only read by the rate limit service"),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_values_are_refused_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    assert message in str(caught.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(helm.HelmError) as caught:
        render({"replicaCount": 2, "redis": {"mode": "sentinel"}, "containerPorts": {"proxy": 1, "admin": 1}})
    text = str(caught.value)
    assert "VALUES VALIDATION" in text
    assert text.count("\n  - ") == 3, text


# --- values.yaml documentation and schema -------------------------------------------------------------

def leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaf_paths(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def test_every_value_is_documented_where_it_stands() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    params = dict(re.findall(r"^\s*## @param (\S+) (.+)$", text, re.M))
    for path in leaf_paths(values):
        parts = path.split(".")
        documented = [".".join(parts[: i + 1]) for i in range(len(parts)) if ".".join(parts[: i + 1]) in params]
        assert documented, f"values.yaml: {path} has no ## @param"
    for name, description in params.items():
        node: Any = values
        for part in name.split("."):
            assert isinstance(node, dict) and part in node, f"## @param {name} names no value"
            node = node[part]
        assert len(description.split()) >= 3, f"## @param {name}: say what it does"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"]) - {"global"}, "values.yaml and values.schema.json disagree"
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)


# --- the wheel and the image's entry command, outside Docker --------------------------------------------

@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built like the Dockerfile's builder does, from only the files it copies."""
    source = tmp_path_factory.mktemp("context")
    for name in builder_sources():
        origin = ROOT / name.rstrip("/")
        if origin.is_dir():
            shutil.copytree(origin, source / origin.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / origin.name)
    dist = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dist), str(source)],
                   check=True, capture_output=True, timeout=300)
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv without pip, the wheel and its dependencies installed into it from outside (as the
    builder stage does; from the index or pip's cache). Returns its bin/."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "--quiet",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    return home / "bin"


@pytest.mark.timeout(300)
def test_wheel_holds_the_package_and_its_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("gateway/lua/decide.lua", "gateway/cli.py", "gateway/config/loader.py", "gateway/py.typed",
                   "gateway/routes.schema.json"):
        assert needed in names, f"{needed} missing from {wheel.name}"
    assert not [n for n in names if n.startswith(("tests/", "bench/", "helm/", "lua/"))]
    assert [n for n in names if n.endswith(".dist-info/licenses/LICENSE")], "the licence travels with the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "gateway = gateway.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def clean_env(bin_dir: Path, workdir: Path) -> dict[str, str]:
    """The image's environment, with the venv for /opt/gateway and temporary paths for /tmp and /etc."""
    env = {"HOME": str(workdir), "LANG": "C.UTF-8"}
    for key, value in runtime_env().items():
        env[key] = value.replace("/opt/gateway/bin", str(bin_dir)).replace("$PATH", "/usr/bin:/bin")
    env["TMPDIR"] = str(workdir / "tmp")
    env["GATEWAY_CONFIG"] = str(workdir / "etc" / "routes.yaml")
    (workdir / "tmp").mkdir()
    (workdir / "etc").mkdir()
    shutil.copy2(ROOT / "routes.yaml", workdir / "etc" / "routes.yaml")
    return env


@pytest.mark.timeout(600)
def test_installed_wheel_runs_the_cli(installed: Path, tmp_path: Path) -> None:
    env = clean_env(installed, tmp_path)
    assert not (installed / "pip").exists(), "the runtime venv carries no installer"
    which = subprocess.run(["python", "-c", "import gateway, gateway.lua; print(gateway.__file__)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert which.stdout.startswith(str(installed.parent)), "the installed wheel, not the source tree"
    shown = subprocess.run(["gateway", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and "serve" in shown.stdout and "check" in shown.stdout
    checked = subprocess.run(["gateway", "check", "etc/routes.yaml"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    assert "ok" in checked.stdout
    (tmp_path / "bad.yaml").write_text("version: 1\nupstreams: {}\nroutes: [{name: r}]\n")
    refused = subprocess.run(["gateway", "check", "bad.yaml"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "bad.yaml:" in refused.stderr


@pytest.mark.timeout(600)
def test_the_runtime_dependencies_alone_run_every_module(installed: Path, tmp_path: Path) -> None:
    """`make run` installs only `pip install -e .` (no dev tools): every gateway module, the example
    backend included, imports with the runtime dependencies alone (the wheel's venv)."""
    planned = subprocess.run(["make", "-n", "run", f"VENV={tmp_path / 'v'}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    assert "pip install -q -e .\n" in planned and "[dev]" not in planned
    modules = sorted(f"gateway.{p.relative_to(ROOT / 'gateway').with_suffix('').as_posix().replace('/', '.')}"
                     for p in (ROOT / "gateway").rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    env = clean_env(installed, tmp_path)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(len(sys.argv) - 1)"
    imported = subprocess.run(["python", "-c", code, *modules], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert int(imported.stdout) == len(modules) and "gateway.example_backend" in modules


@pytest.mark.timeout(600)
def test_image_entry_command_serves_and_passes_its_healthcheck(installed: Path, tmp_path: Path) -> None:
    """ENTRYPOINT + CMD with the image's ENV (embedded Redis under TMPDIR); HEALTHCHECK; SIGTERM -> 0."""
    env = clean_env(installed, tmp_path)
    env["GATEWAY_PORT"], env["GATEWAY_ADMIN_PORT"] = str(free_port()), str(free_port())
    log = (tmp_path / "gateway.log").open("wb")
    process = started(entry_command(), env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        def healthy() -> bool:
            assert process.poll() is None, (tmp_path / "gateway.log").read_text()
            return subprocess.run(healthcheck_command(), env=env, cwd=tmp_path, capture_output=True,
                                  timeout=10).returncode == 0

        wait_until(healthy, timeout=60, interval=0.3)
        ready = subprocess.run(["python", "-c", "import os, urllib.request; print(urllib.request.urlopen("
                                "'http://127.0.0.1:%s/readyz' % os.environ['GATEWAY_ADMIN_PORT']).status)"],
                               env=env, capture_output=True, text=True, timeout=30)
        assert ready.stdout.strip() == "200", ready.stderr
        assert any(tmp_path.joinpath("tmp").iterdir()), "the embedded Redis and metrics live under TMPDIR"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, (tmp_path / "gateway.log").read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and subprocess.run(healthcheck_command(), env=env,
                                                         capture_output=True).returncode == 0:
        time.sleep(0.2)
    assert subprocess.run(healthcheck_command(), env=env, capture_output=True).returncode != 0


# --- the Grafana dashboard, the alerts and the Ingress ----------------------------------------------

OPERATORS_KIT = SCENARIOS["dashboard-alerts-ingress"]
# Labels Prometheus adds to every series it scrapes through the chart's ServiceMonitor (target labels)
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint"}
PROMTOOL = shutil.which("promtool")


def dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    (text,) = config_map["data"].values()
    board: dict[str, Any] = json.loads(text)
    return board


def dashboard_expressions(board: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    exprs += [var["query"]["query"] for var in board["templating"]["list"] if var["type"] == "query"]
    return exprs


def alert_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = one(docs, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_dashboard_rule_and_ingress_are_off_by_default_and_render_as_configured() -> None:
    kinds = {d["kind"] for d in manifests({})}
    assert not kinds & {"PrometheusRule", "Ingress"}
    assert [d for d in manifests({}) if d["kind"] == "ConfigMap"] == [one(manifests({}), "ConfigMap")]

    docs = manifests(OPERATORS_KIT)
    config_map = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1", "Grafana's sidecar finds it by label"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Gateways"}
    board = dashboard(docs)
    titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
    for wanted in ("Requests by route and outcome", "Refusals by rule", "Redis decision latency",
                   "Circuit breaker", "Upstream latency", "Upstream errors"):
        assert wanted in titles
    for panel in board["panels"]:
        if panel["type"] not in ("row", "text"):
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
    (top,) = [p for p in board["panels"] if p["type"] == "text"]
    assert "/top?window=15m" in top["options"]["content"], "who is refused: the admin API's top list"
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])

    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack", "the label Prometheus selects rules by"
    rules = alert_rules(docs)
    assert {r["alert"] for r in rules} == {"GatewayRedisBreakerOpen", "GatewayDecidingWithoutRedis",
                                           "GatewayRedisLatencyHigh", "GatewayUpstreamErrors",
                                           "GatewayConfigReloadFailed"}
    for r in rules:
        assert r["labels"]["team"] == "edge" and r["labels"]["severity"] in ("warning", "critical")
        assert f'namespace="{NAMESPACE}", service="{FULLNAME}-admin"' in r["expr"], "only this release's pods"

    ingress = one(docs, "Ingress")
    proxy = one(docs, "Service")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert ingress["spec"]["tls"] == OPERATORS_KIT["ingress"]["tls"]
    assert [r["host"] for r in ingress["spec"]["rules"]] == ["shop.example.com", "api.example.com"]
    for rule_ in ingress["spec"]["rules"]:
        for path in rule_["http"]["paths"]:
            assert path["backend"]["service"] == {"name": proxy["metadata"]["name"],
                                                  "port": {"name": proxy["spec"]["ports"][0]["name"]}}
    assert [p["pathType"] for p in ingress["spec"]["rules"][1]["http"]["paths"]] == ["Prefix", "Exact"]

    env = pod_env(one(docs, "Deployment"))
    assert env["UPSTREAM_BACKEND"] == "http://shop.shop.svc:8080"
    assert env["UPSTREAM_PAYMENTS_API"] == "https://payments.example.net"
    assert "url: ${UPSTREAM_BACKEND:-http://backend:8080}" in one(docs, "ConfigMap")["data"]["routes.yaml"]
    assert "UPSTREAM_BACKEND" not in pod_env(one(manifests({}), "Deployment")), "the routes' default then"
    notes = render(OPERATORS_KIT)["gateway/templates/NOTES.txt"]
    assert "https://shop.example.com/, https://api.example.com/v1" in notes and "trusted_proxies" in notes
    assert f"PrometheusRule {FULLNAME}" in notes and f"ConfigMap {FULLNAME}-dashboard" in notes
    assert "Ingress:" not in render({})["gateway/templates/NOTES.txt"]


def rules_file(tmp_path: Path, with_annotations: bool = True) -> Path:
    groups = one(manifests(OPERATORS_KIT), "PrometheusRule")["spec"]["groups"]
    if not with_annotations:
        groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
                  for g in groups]
    path = tmp_path / ("rules.yaml" if with_annotations else "rules-bare.yaml")
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """One input series of this release's pods (as the ServiceMonitor labels them)."""
    every = {"namespace": NAMESPACE, "service": f"{FULLNAME}-admin", "pod": "edge-gateway-0", **labels}
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in every.items()) + "}", "values": values}


def test_alerts_fire_as_docs_operations_describes(tmp_path: Path) -> None:
    """promtool (Debian's prometheus package; `make system-deps` installs it) checks the rules and
    their templates, then plays series through them: each alert fires when it should, only after its
    `for:`, and never for another release's pods."""
    assert PROMTOOL, "promtool is missing: run `make system-deps` (Debian package prometheus)"
    checked = subprocess.run([PROMTOOL, "check", "rules", str(rules_file(tmp_path))], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    other = {"service": "another-gateway-admin"}
    buckets = [("0.025", "0+0x30"), ("0.05", "0+600x30"), ("+Inf", "0+600x30")]
    input_series = [
        series("gateway_redis_breaker_state", "0 0 1x30"),
        series("gateway_redis_breaker_state", "1x30", **other),
        series("gateway_requests_total", "0 0 0+60x30", route="seckill", outcome="failed_closed"),
        series("gateway_requests_total", "0+600x30", route="seckill", outcome="admitted"),
        *[series("gateway_redis_latency_seconds_bucket", v, le=le, result="ok") for le, v in buckets],
        series("gateway_upstream_errors_total", "0+60x30", upstream="shop", kind="unavailable"),
        series("gateway_upstream_latency_seconds_count", "0+540x30", upstream="shop"),  # 10% fail
        series("gateway_upstream_errors_total", "0+6x30", upstream="payments", kind="timeout"),
        series("gateway_upstream_latency_seconds_count", "0+600x30", upstream="payments"),  # 1%
        series("gateway_upstream_errors_total", "0+60x30", upstream="down", kind="unavailable"),  # never answers
        series("gateway_config_reloads_total", "0 0 0 0 0 1x30", result="error"),
        series("gateway_config_reloads_total", "0+1x30", result="ok"),
    ]
    team = {"team": "edge", "namespace": NAMESPACE}
    cases = [
        (1, "GatewayRedisBreakerOpen", []),  # open for less than its `for: 1m`
        (4, "GatewayRedisBreakerOpen", [{**team, "severity": "critical", "pod": "edge-gateway-0"}]),
        (3, "GatewayDecidingWithoutRedis", []),
        (6, "GatewayDecidingWithoutRedis", [{**team, "severity": "warning", "route": "seckill",
                                              "outcome": "failed_closed"}]),
        (5, "GatewayRedisLatencyHigh", []),
        (20, "GatewayRedisLatencyHigh", [{**team, "severity": "warning"}]),
        (20, "GatewayUpstreamErrors", [{**team, "severity": "warning", "upstream": "down"},
                                       {**team, "severity": "warning", "upstream": "shop"}]),
        (4, "GatewayConfigReloadFailed", []),
        (6, "GatewayConfigReloadFailed", [{**team, "severity": "warning"}]),
        (25, "GatewayConfigReloadFailed", []),  # ten minutes after the last refused reload
    ]
    tests = {"rule_files": [str(rules_file(tmp_path, with_annotations=False))], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": [
                 {"eval_time": f"{minute}m", "alertname": name, "exp_alerts": [{"exp_labels": labels}
                                                                              for labels in expected]}
                 for minute, name, expected in cases]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    played = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True,
                            text=True, timeout=60)
    assert played.returncode == 0, played.stdout + played.stderr
    assert {name for _, name, _ in cases} == {r["alert"] for r in alert_rules(manifests(OPERATORS_KIT))}


LIVE_ROUTES = """
version: 1
redis: {{timeout: 200ms}}
upstreams:
  up: {{url: "{upstream}"}}
  nowhere: {{url: "http://127.0.0.1:{closed}", connect_timeout: 1s}}
routes:
  - name: limited
    match: {{path: /echo/limited}}
    upstream: up
    limits:
      - {{name: once, by: [ip], algorithm: fixed_window, limit: 1, window: 1h}}
      - {{name: shadowed, by: [ip], algorithm: fixed_window, limit: 1, window: 1h, shadow: true}}
  - name: broken
    match: {{path: /broken}}
    upstream: nowhere
    limits: [{{name: g, by: [], algorithm: gcra, rate: 100/s, burst: 100}}]
  - name: protected
    match: {{path: /inflight}}
    upstream: up
    protect: {{min_limit: 1, max_limit: 1}}
  - name: fleet
    match: {{path: /echo/fleet}}
    upstream: up
    protect: {{scope: fleet}}
  - name: queued
    match: {{path: /echo/queued}}
    upstream: up
    protect: {{priorities: [{{name: all, queue: {{size: 1}}}}]}}
"""


def live_scrape(tmp_path: Path, upstream_url: str) -> dict[str, set[str]]:
    """A real gateway's /metrics after an admitted, a refused, a shadow-refused, an upstream-failed
    request, a reload and a Redis outage: every series name with the label names it carries."""
    redis = RedisProcess()
    redis.start()
    gateway = GatewayProcess(LIVE_ROUTES.format(upstream=upstream_url, closed=free_port()), tmp_path,
                             redis_url=redis.url)
    gateway.start()
    try:
        assert httpx.get(gateway.url + "/echo/limited").status_code == 200
        assert httpx.get(gateway.url + "/echo/limited").status_code == 429
        # the dashboard's "Top refused identities" panel sends operators here
        top = httpx.get(gateway.admin_url + "/top", params={"window": "15m", "limit": "20"}).json()["top"]
        assert [(t["route"], t["rule"], t["refusals"]) for t in top] == [("limited", "once", 1)]
        assert httpx.get(gateway.url + "/broken").status_code == 502
        with ThreadPoolExecutor(1) as pool:  # protect: one request in flight, the next one shed
            before = httpx.get(upstream_url + "/inflight-max").json()["now"]
            held = pool.submit(httpx.get, gateway.url + "/inflight", params={"delay": 3}, timeout=20)
            wait_until(lambda: httpx.get(upstream_url + "/inflight-max").json()["now"] > before)  # it holds the place
            assert httpx.get(gateway.url + "/inflight", params={"delay": 0}).status_code == 503
            assert held.result().status_code == 200
        for _ in range(15):  # a window of answers: the answer time the limit sees
            assert httpx.get(gateway.url + "/inflight", params={"delay": 0.01}).status_code == 200
        assert httpx.post(gateway.admin_url + "/reload").status_code == 200
        redis.stop()
        assert httpx.get(gateway.url + "/broken").status_code == 502  # failed open, then the upstream failed
        text = httpx.get(gateway.admin_url + "/metrics").text
    finally:
        gateway.stop()
        redis.stop()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def referenced(expr: str) -> list[tuple[str, set[str]]]:
    """Each metric an expression reads, with the label names its selector matches on."""
    uses = []
    for match in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, selector = match.group(1), match.group(2) or ""
        if name.startswith("gateway_"):
            uses.append((name, set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))))
    return uses


def grouped_by(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


@pytest.mark.timeout(120)
def test_every_dashboard_and_alert_expression_reads_what_the_gateway_exports(tmp_path: Path,
                                                                            upstream: Upstream) -> None:
    docs = manifests(OPERATORS_KIT)
    expressions = dashboard_expressions(dashboard(docs)) + [r["expr"] for r in alert_rules(docs)]
    scraped = live_scrape(tmp_path, upstream.url)
    assert len(expressions) > 20
    for expr in expressions:
        uses = referenced(expr)
        assert uses, f"reads no gateway metric: {expr}"
        labels = set().union(*(scraped.get(name, set()) for name, _ in uses)) | TARGET_LABELS | {"le"}
        for name, matched in uses:
            assert name in scraped, f"{name} is not in a live /metrics (read by: {expr})"
            assert matched <= scraped[name] | TARGET_LABELS, f"{name} has no label {matched - scraped[name]}: {expr}"
        assert grouped_by(expr) <= labels, f"grouped by a label no series has: {expr}"
    every_metric = {name for name in scraped if name.startswith("gateway_")}
    shown = {name for expr in expressions for name, _ in referenced(expr)}
    families = {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in every_metric}
    assert families <= {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in shown}, "every metric on the board"


def deploy_doc_block(first_line: str) -> str:
    """The ```yaml block of docs/deploy.md whose first line is `first_line`."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        if block.startswith(first_line + "\n"):
            return str(block)
    raise AssertionError(f"docs/deploy.md has no yaml block starting {first_line!r}")


@pytest.mark.timeout(120)
def test_the_deploy_docs_walk_from_helm_install_to_a_429(tmp_path: Path, upstream: Upstream) -> None:
    """docs/deploy.md's routes-shop.yaml and values-shop.yaml, as written there: the chart takes them
    (strict lint, valid manifests, an Ingress to the proxy Service, the shop's URL in the pods), and
    the routes, served by a real gateway in front of a real upstream, answer the sixth login with 429."""
    routes = deploy_doc_block("# routes-shop.yaml")
    values = {**yaml.safe_load(deploy_doc_block("# values-shop.yaml")), "routes": routes}
    report = helm.lint(CHART, values, strict=True, namespace="edge", kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="shop-edge", namespace="edge")
    docs = [d for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        if doc["kind"] not in CRD_SCHEMAS:
            kv.validate(doc, KUBE_VERSIONS[-1], strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"Ingress", "PrometheusRule", "ServiceMonitor"} <= kinds
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    assert ingress["metadata"]["name"] == "shop-edge-gateway"
    assert ingress["spec"]["rules"][0]["host"] == "shop.example.com"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = pod_env(deployment)
    assert env["UPSTREAM_SHOP"] == "http://shop.shop.svc:8080" and "UPSTREAM_BACKEND" not in env

    redis = RedisProcess()
    redis.start()
    gateway = GatewayProcess(routes, tmp_path, redis_url=redis.url, env={"UPSTREAM_SHOP": upstream.url})
    gateway.start()
    try:
        checked = subprocess.run([sys.executable, "-m", "gateway", "check", str(gateway.config_path)], cwd=ROOT,
                                 env={**os.environ, "UPSTREAM_SHOP": "http://shop:8080"}, capture_output=True,
                                 text=True, timeout=60)
        assert checked.stdout.strip() == f"{gateway.config_path}: ok (2 routes, 2 rules, 1 upstream)", checked.stderr
        logins = [httpx.post(gateway.url + "/login", content=b'{"user": "a"}') for _ in range(6)]
        assert [r.status_code for r in logins] == [200] * 5 + [429]
        refused = logins[-1]
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["ratelimit-policy"] == '"per-ip";q=5;w=900'
        assert 0 < int(refused.headers["retry-after"]) <= 900
        assert refused.json()["route"] == "login" and refused.json()["rule"] == "per-ip"
    finally:
        gateway.stop()
        redis.stop()
