"""The observability bundle against real parts: Debian's Prometheus scrapes a real `moecache serve`
every second with the shipped scrape config, and every PromQL expression of the shipped Grafana
dashboard returns data through Prometheus's HTTP API after some traffic."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.serve_process import ServeProcess, get_text, post_json, serve_process

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "moecache.json"
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval stands for in these queries


@dataclass(frozen=True)
class Target:
    panel: str
    expr: str


def dashboard_targets() -> list[Target]:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [Target(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["query"]["query"])
        assert inner is not None, f"variable {variable['name']}: unknown query {variable['query']}"
        targets.append(Target(f"variable {variable['name']}", inner.group(1)))
    return targets


def as_promql(expr: str, model: str) -> str:
    """The query Grafana sends, with its variables replaced."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400 and 422 carry Prometheus's reason
            body = json.loads(error.read())
        assert body["status"] == "success", f"{promql}: {body}"
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if result := self.query(promql):
                    return result
            except OSError:
                pass  # still starting
            time.sleep(0.25)
        raise TimeoutError(f"Prometheus never answered {promql!r} with data")


@pytest.fixture(scope="module")
def moecache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(log, {"MOECACHE_CPU_MOE": "1", "MOECACHE_MOE_CACHE_MIB": "8"}) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(moecache: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs Debian's prometheus (apt-get install prometheus)")
    work = tmp_path_factory.mktemp("prometheus")
    config = scrape_config_for(moecache.port)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (work / "prometheus.log").open("wb") as log:
        process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Prometheus(port)
    finally:
        process.terminate()
        process.wait(30)


def scrape_config_for(port: int) -> dict[str, Any]:
    """The shipped config, scraping the test's server every second instead of the compose service."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "moecache"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    return config


@contextmanager
def traffic(server: ServeProcess, max_requests: int = 60) -> Iterator[list[int]]:
    """Jobs and chat requests one after another in the background, so rates over the window keep
    moving; yields the completion tokens of each finished chat request."""
    stop = threading.Event()
    finished: list[int] = []

    def run() -> None:
        for i in range(max_requests):
            if stop.is_set():
                return
            body = {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 16, "ignore_eos": True}
            job = post_json(server.url("/v1/jobs"), body)  # runs beside the chat: the job panels get data
            out = post_json(server.url("/v1/chat/completions"), body)
            finished.append(out["usage"]["completion_tokens"])
            assert job["status"] == "queued", job

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        yield finished
    finally:
        stop.set()
        worker.join(60)


def queries_without_data(prometheus: Prometheus, model: str) -> list[str]:
    """The dashboard's queries that have no finite value now."""
    empty = []
    for target in dashboard_targets():
        values = [float(r["value"][1]) for r in prometheus.query(as_promql(target.expr, model))]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{target.panel}: {target.expr} -> {values}")
    return empty


def test_shipped_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs Debian's prometheus (promtool)")
    run = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_dashboard_query_returns_data(moecache: ServeProcess, prometheus: Prometheus) -> None:
    prometheus.wait_for('up{job="moecache"} == 1')
    model = json.loads(get_text(moecache.url("/v1/cache/state")))["model"]
    deadline = time.monotonic() + 45
    with traffic(moecache) as finished:
        # series appear with the first request and rates need two scrapes of them: poll until every
        # query has data, or report the ones that never got any
        while True:
            empty = queries_without_data(prometheus, model)
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert finished and set(finished) == {16}, finished
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
