"""`moecache serve` as a real process on a free loopback port, configured only through `MOECACHE_*`
variables (as the container image and the Kubernetes ConfigMap configure it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
KEPT = ("MOECACHE_CACHE_DIR", "MOECACHE_SHARED_DATA")  # where the embedded model and kernels are kept


@dataclass(frozen=True)
class ServeProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def serve_process(log: Path, settings: dict[str, str], timeout: float = 180.0) -> Iterator[ServeProcess]:
    """Start `moecache serve` with `settings` (MOECACHE_* -> value) on the CPU and a free port; yields
    once /health answers 200; SIGTERM (a drain) on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOECACHE_") or k in KEPT}
    # any free ports, and a job store of its own: tests run servers side by side
    env.update({"MOECACHE_HOST": "127.0.0.1", "MOECACHE_PORT": "0", "MOECACHE_GRPC_PORT": "0",
                "MOECACHE_JOBS_DB": f"sqlite:///{log.parent.resolve() / 'jobs.db'}", "MOECACHE_DEVICE": "cpu",
                **settings})
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        port = _wait_for_port(process, log, time.monotonic() + timeout)
        _wait_healthy(process, port, log, time.monotonic() + timeout)
        yield ServeProcess(process, port, log)
    finally:
        _stop(process)


def _wait_for_port(process: subprocess.Popen[bytes], log: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        if (found := LISTENING.search(log.read_text(errors="replace"))) is not None:
            return int(found.group(1))
        _check_alive(process, log)
        time.sleep(0.1)
    raise TimeoutError(f"the server did not bind in time:\n{log.read_text(errors='replace')[-3000:]}")


def _wait_healthy(process: subprocess.Popen[bytes], port: int, log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # 503 while the model loads
        _check_alive(process, log)
        time.sleep(0.2)
    raise TimeoutError(f"the server did not get ready in time:\n{log.read_text(errors='replace')[-3000:]}")


def _check_alive(process: subprocess.Popen[bytes], log: Path) -> None:
    if process.poll() is not None:
        raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text(errors='replace')[-3000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def post_json(url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 120) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()
