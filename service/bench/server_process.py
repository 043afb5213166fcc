"""`moecache serve` as its own process for a benchmark: configured through `MOECACHE_*` variables, on free
ports, with a job store of its own; its log kept for the error when it fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

HTTP_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
GRPC_LISTENING = re.compile(r"gRPC listening on ([\d.]+):(\d+)")
READY = "ready: model"
LOG_LINES = 60


class ServerProcess(AbstractContextManager["ServerProcess"]):
    """Starts on enter, returns once the model is loaded; stops (SIGTERM, a drain) on exit."""

    def __init__(self, settings: Mapping[str, str], jobs_db: Path, timeout_s: float = 600.0) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MOECACHE_") or k == "MOECACHE_CACHE_DIR"}
        self.env.update({"MOECACHE_HOST": "127.0.0.1", "MOECACHE_PORT": "0", "MOECACHE_GRPC_PORT": "0",
                         "MOECACHE_JOBS_DB": f"sqlite:///{jobs_db}", **settings})
        self.timeout_s = timeout_s
        self.url = self.grpc_target = ""
        self._log: deque[str] = deque(maxlen=LOG_LINES)
        self._ready = threading.Event()
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        self._process = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=self.env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not self._ready.wait(0.2):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the server did not get ready:\n{self.log_tail()}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def log_tail(self) -> str:
        return "".join(self._log)

    def _read_log(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            self._log.append(line)
            if found := HTTP_LISTENING.search(line):
                self.url = f"http://{found.group(1)}:{found.group(2)}"
            elif found := GRPC_LISTENING.search(line):
                self.grpc_target = f"{found.group(1)}:{found.group(2)}"
            elif READY in line:
                self._ready.set()
