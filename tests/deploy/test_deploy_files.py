"""deploy/ checked offline: the Helm chart rendered (tests/deploy/gotemplate.py: the subset of
Go templates the chart uses) and every manifest validated against the Kubernetes schemas
(kubernetes-validate, strict); the compose file parsed and checked against the CLI (and by
`docker compose config` where the compose plugin exists); the Dockerfile's stages."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from control_plane.observability.routes import web_dir
from events.control import sku_id_for
from events.nats_cluster import nats_servers
from tests.deploy.gotemplate import Chart, TemplateError
from tokenmill.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"
REQUIRED = {
    "secrets": {"adminToken": "admin-secret", "databaseUrl": "postgresql://u:p@pg:5432/tm"},
    "worker": {"skuId": "sku_dfb8f04177005bce", "model": "SmolLM2-135M-Instruct"},
}
CLI_COMMANDS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def _docs(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]


def _validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _by(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.fixture(scope="module")
def chart() -> Chart:
    return Chart(DEPLOY / "helm" / "tokenmill")


def test_chart_defaults_render_valid_manifests(chart: Chart) -> None:
    docs = _docs(chart.render(REQUIRED))
    _validate(docs)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted(
        [
            ("Deployment", "tm-gateway"),
            ("Deployment", "tm-projector"),
            ("Deployment", "tm-scheduler"),
            ("Deployment", "tm-worker"),
            ("HorizontalPodAutoscaler", "tm-gateway"),
            ("PodDisruptionBudget", "tm-gateway"),
            ("Secret", "tm-tokenmill"),
            ("Service", "tm-gateway"),
        ]
    )
    gateway = _by(docs, "Deployment", "tm-gateway")
    g = _container(gateway)
    assert g["args"] == ["tokenmill", "serve"]
    assert g["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert g["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "replicas" not in gateway["spec"]  # the HPA owns the count
    hpa = _by(docs, "HorizontalPodAutoscaler", "tm-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tm-gateway",
    }
    env = _env(g)
    assert len(nats_servers(env["TOKENMILL_NATS_URL"])) == 3
    assert env["TOKENMILL_STREAM_REPLICAS"] == "3"
    assert env["TOKENMILL_ADMIN_TOKEN"] == {
        "secretKeyRef": {"name": "tm-tokenmill", "key": "admin-token"}
    }
    secret = _by(docs, "Secret", "tm-tokenmill")
    assert secret["stringData"]["admin-token"] == "admin-secret"
    # the projector stands by in a second replica; the scheduler closes invoices
    assert _by(docs, "Deployment", "tm-projector")["spec"]["replicas"] == 2
    assert _container(_by(docs, "Deployment", "tm-projector"))["args"] == ["tokenmill", "project"]
    assert _container(_by(docs, "Deployment", "tm-scheduler"))["args"] == [
        "tokenmill",
        "scheduler",
    ]
    worker = _by(docs, "Deployment", "tm-worker")
    w = _container(worker)
    assert w["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert w["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    assert worker["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "tokenmill-models",
        "readOnly": True,
    }
    assert _env(w)["TOKENMILL_WORKER_SKU"] == "sku_dfb8f04177005bce"
    # every command the chart runs is one the CLI has
    for d in docs:
        if d["kind"] == "Deployment":
            args = _container(d)["args"]
            assert args[0] == "tokenmill" and args[1] in CLI_COMMANDS


def test_chart_in_cluster_dependencies_and_existing_secret(chart: Chart) -> None:
    docs = _docs(
        chart.render(
            {
                "secrets": {"existingSecret": "mine"},
                "nats": {"enabled": True},
                "postgresql": {"enabled": True},
                "worker": {"enabled": False},
                "gateway": {"autoscaling": {"enabled": False}, "replicas": 3},
            },
            release="prod",
        )
    )
    _validate(docs)
    kinds = {d["kind"] for d in docs}
    assert "Secret" not in kinds and "HorizontalPodAutoscaler" not in kinds
    assert not [d for d in docs if d["metadata"]["name"] == "prod-worker"]
    gateway = _by(docs, "Deployment", "prod-gateway")
    assert gateway["spec"]["replicas"] == 3
    env = _env(_container(gateway))
    assert env["TOKENMILL_NATS_URL"] == "nats://prod-nats:4222"
    assert env["TOKENMILL_DATABASE_URL"] == (
        "postgresql://tokenmill:$(TOKENMILL_PG_PASSWORD)@prod-postgresql:5432/tokenmill"
    )
    names = [e["name"] for e in _container(gateway)["env"]]
    # Kubernetes expands $(VAR) only from variables defined before it
    assert names.index("TOKENMILL_PG_PASSWORD") < names.index("TOKENMILL_DATABASE_URL")
    assert env["TOKENMILL_ADMIN_TOKEN"]["secretKeyRef"]["name"] == "mine"


def test_chart_requires_the_admin_token(chart: Chart) -> None:
    with pytest.raises(TemplateError, match="adminToken"):
        chart.render({"worker": REQUIRED["worker"]})
    with pytest.raises(TemplateError, match="skuId"):
        chart.render({"secrets": REQUIRED["secrets"]})


def test_plain_kubernetes_manifests_are_valid() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "tokenmill.yaml").read_text())]
    _validate(docs)
    commands = {_container(d)["args"][1] for d in docs if d["kind"] == "Deployment"}
    assert commands == {"serve", "project", "scheduler"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # merge keys (<<) resolved


def test_compose_runs_the_production_shape(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nats_nodes = sorted(n for n in services if n.startswith("nats-"))
    assert nats_nodes == ["nats-0", "nats-1", "nats-2"]
    for node in nats_nodes:
        cmd = services[node]["command"]
        assert "-js" in cmd and cmd[cmd.index("--cluster_name") + 1] == "tokenmill"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert sorted(routes) == sorted(f"nats://{o}:6222" for o in nats_nodes if o != node)
    commands: dict[str, list[str]] = {
        name: s["command"] for name, s in services.items() if s.get("command")
    }
    for name, cmd in commands.items():
        if cmd[0] == "tokenmill":
            assert cmd[1] in CLI_COMMANDS, name
    assert commands["gateway-1"] == commands["gateway-2"] == ["tokenmill", "serve"]
    assert commands["projector"] == ["tokenmill", "project"]
    assert services["projector"]["deploy"]["replicas"] == 2
    assert commands["scheduler"] == ["tokenmill", "scheduler"]
    assert commands["worker"] == ["tokenmill", "worker"]
    # one address for both gateways
    conf = (DEPLOY / "nginx.conf").read_text()
    assert re.findall(r"server (gateway-\d):8080", conf) == ["gateway-1", "gateway-2"]
    assert services["lb"]["ports"] == ["8080:8080"]
    env = services["gateway-1"]["environment"]
    assert nats_servers(env["TOKENMILL_NATS_URL"]) == [f"nats://{n}:4222" for n in nats_nodes]
    assert int(env["TOKENMILL_STREAM_REPLICAS"]) == len(nats_nodes)
    worker_env = services["worker"]["environment"]
    assert worker_env["TOKENMILL_WORKER_SKU"] == sku_id_for(worker_env["TOKENMILL_WORKER_MODEL"])
    assert services["worker"]["build"]["target"] == "worker"
    assert services["gateway-1"]["build"]["target"] == "control-plane"


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="no docker compose plugin on this machine",
)
def test_docker_compose_accepts_the_file() -> None:
    subprocess.run(
        ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "-q"],
        check=True,
        env={**os.environ, "TOKENMILL_ADMIN_TOKEN": "x"},
    )


def test_dockerfile_stages_and_the_ops_page(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)", text, re.MULTILINE)
    assert stages == ["source", "worker", "control-plane"]  # the last is the default
    copies = dict(re.findall(r"^COPY (\S+) (\S+)$", text, re.MULTILINE))
    for package in ("control_plane", "events", "pricing", "worker", "web"):
        assert copies.get(package) == package, package
    assert re.search(r"TOKENMILL_WEB_DIR=/app/web\b", text)
    assert '".[worker]"' in text
    # what the image's TOKENMILL_WEB_DIR points at is the page /ui/ serves
    monkeypatch.setenv("TOKENMILL_WEB_DIR", str(ROOT / "web"))
    assert (web_dir() / "index.html").is_file()
