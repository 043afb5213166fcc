"""The Kubernetes manifests: valid against the API schemas (kubernetes-validate; the custom resources
checked field by field), and consistent with each other and with the server they run."""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.async_engine import EngineSnapshot
from service.cli import build_parser
from service.commands.serve import serve_options
from service.metrics import Metrics
from service.options import env_name
from service.server import HANDLER_GRACE_S

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the oldest with preStop `sleep` on by default, and the newest
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("kustomize.config.k8s.io/v1beta1", "Kustomization")}
MODEL_LOAD_BUDGET_S = 600  # a 17 GB model from network storage


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one resource of that kind in deploy/k8s/*.yaml."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"two {doc['kind']} resources"
            found[doc["kind"]] = doc
    return found


def container(resources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (main,) = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    return main


def serve_flag_variables() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {env_name(a.dest) for a in sub.choices["serve"]._actions if a.dest != "help"}


def test_every_manifest_passes_the_kubernetes_schema() -> None:
    validation = pytest.importorskip("kubernetes_validate")
    checked = 0
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
                continue
            for version in KUBERNETES_VERSIONS:
                validation.validate(doc, version, strict=True)  # raises ValidationError naming the field
            checked += 1
    assert checked == 7


def test_service_monitor_scrapes_the_service() -> None:
    resources = manifests()
    monitor, service = resources["ServiceMonitor"], resources["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["name"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), "the monitor must select the Service"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = manifests()["Kustomization"]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_deployment_gets_a_gpu_and_probes_health_with_a_long_start() -> None:
    resources = manifests()
    main = container(resources)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = main[kind]["httpGet"]
        assert probe["path"] == "/health" and probe["port"] == "http", kind
    startup = main["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= MODEL_LOAD_BUDGET_S


def test_termination_grace_outlasts_the_drain() -> None:
    resources = manifests()
    spec = resources["Deployment"]["spec"]["template"]["spec"]
    shutdown = float(resources["ConfigMap"]["data"]["MOECACHE_SHUTDOWN_TIMEOUT"])
    pre_stop = container(resources)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + shutdown + HANDLER_GRACE_S


def test_selectors_and_ports_meet() -> None:
    resources = manifests()
    deployment = resources["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert resources["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in container(resources)["ports"]}
    assert {p["targetPort"] for p in resources["Service"]["spec"]["ports"]} == container_ports
    claim = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert claim["persistentVolumeClaim"]["claimName"] == resources["PersistentVolumeClaim"]["metadata"]["name"]
    mount = next(m for m in container(resources)["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == "/models"
    assert resources["ConfigMap"]["data"]["MOECACHE_MODEL"].startswith("/models/")


def test_autoscaler_follows_the_waiting_requests_the_server_exports() -> None:
    resources = manifests()
    hpa = resources["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", resources["Deployment"]["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert metric["type"] == "Pods" and name == "moecache_requests_waiting"
    metrics = Metrics("m")
    metrics.watch(lambda: EngineSnapshot(), lambda: 0)
    assert f"\n{name}{{" in metrics.render()[0].decode(), "the server must export the scaling metric"
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["seriesQuery"].startswith(name + "{") and rule["name"]["as"] == name


def test_config_is_made_of_serve_flags_and_the_server_accepts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    resources = manifests()
    data = resources["ConfigMap"]["data"]
    assert set(data) <= serve_flag_variables(), set(data) - serve_flag_variables()
    main = container(resources)
    assert main["envFrom"] == [{"configMapRef": {"name": resources["ConfigMap"]["metadata"]["name"]}}]
    for name, value in data.items():
        monkeypatch.setenv(name, value)
    options = serve_options(build_parser().parse_args(["serve"]))
    assert (options.host, options.port, options.grpc_port) == ("0.0.0.0", 8000, 50051)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert (ports["http"], ports["grpc"]) == (options.port, options.grpc_port)


def test_secrets_hold_the_key_and_a_shared_postgres_job_store() -> None:
    resources = manifests()
    secret = resources["Secret"]
    from_secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(resources)["env"]}
    assert set(from_secret) == {"MOECACHE_API_KEY", "MOECACHE_JOBS_DB"}
    for name, ref in from_secret.items():
        assert ref == {"name": secret["metadata"]["name"], "key": name}
        assert name in secret["stringData"]
    assert set(from_secret) <= serve_flag_variables()
    assert urllib.parse.urlsplit(secret["stringData"]["MOECACHE_JOBS_DB"]).scheme == "postgresql"
