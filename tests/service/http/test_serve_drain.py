"""`moecache serve` as a real process: SIGTERM drains (503 for newcomers, the running stream ends with
its last chunk and `[DONE]`), the engine closes with its cache summary, and the process exits 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from http_servers import greedy, read_events

ROOT = Path(__file__).resolve().parents[3]


class ServeProcess:
    """`python -m service.cli serve` on port 0; stderr is collected line by line in a thread."""

    def __init__(self, model: Path, *args: str) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", "-m", str(model), "--port", "0", "--ctx-size", "256",
               "--device", "cpu", "--max-num-seqs", "4", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if match := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
                self.port = int(match.group(1))
            if "ready: model" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = 60) -> None:
        if not self._ready.wait(timeout):
            raise AssertionError("the server did not become ready:\n" + "".join(self.lines))

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture
def serve_process(tiny_gguf: Path) -> Iterator[ServeProcess]:
    process = ServeProcess(tiny_gguf, "--shutdown-timeout", "1")
    yield process
    if process.proc.poll() is None:
        process.proc.kill()
        process.proc.wait()


async def first_events(response: aiohttp.ClientResponse, count: int) -> None:
    seen = 0
    while seen < count:
        seen += (await response.content.readline()).startswith(b"data:")


async def poll_health(http: aiohttp.ClientSession, url: str, status: int) -> None:
    while True:
        async with http.get(url) as r:
            if r.status == status:
                return
        await asyncio.sleep(0.02)


async def test_sigterm_drains_the_stream_and_exits_zero(serve_process: ServeProcess) -> None:
    serve_process.wait_ready()
    async with aiohttp.ClientSession() as http:
        body = greedy(max_tokens=250, prompt="Hello", stream=True)
        async with http.post(serve_process.url("/v1/completions"), json=body) as stream:
            await first_events(stream, 2)
            serve_process.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(poll_health(http, serve_process.url("/health"), 503), 10)
            async with http.post(serve_process.url("/v1/completions"), json=greedy(prompt="late")) as late:
                assert late.status == 503 and (await late.json())["error"]["code"] == "draining"
            events = await read_events(stream)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("abort", "length")
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])
    assert await asyncio.to_thread(serve_process.proc.wait, 30) == 0
    log = "".join(serve_process.lines)
    assert "experts:" in log and "expert cache, batches" in log and "stopped" in log
