"""Helpers of the HTTP tests: a real `Server` on a loopback port run by its own event loop in a
background thread, `moecache serve` as a real subprocess, the engine config of the tests, and SSE
reading."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from service.server import ServeOptions, Server

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[3]
Progress = Callable[[str, int, int], None]


def engine_config(path: Path, cached: bool = False) -> EngineConfig:
    """ctx 256 and up to 32 sequences; `cached`: experts in host RAM behind a 1 MiB expert cache."""
    cache = CacheConfig(cpu_moe=True, budget_mib=1) if cached else CacheConfig()
    return EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=256), cache=cache,
                        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256))


class ServerThread:
    """A real `Server` on 127.0.0.1, port 0, driven by its own event loop in a background thread."""

    def __init__(self, config: EngineConfig, options: ServeOptions | None = None, engine: LLMEngine | None = None,
                 progress: Progress | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = Server(config, options or ServeOptions(port=0), progress, engine)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._started: Future[None] | None = None

    def start(self, wait_ready: bool = True) -> ServerThread:
        self._thread.start()
        self._started = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        if wait_ready:
            self._started.result(timeout=120)
        return self

    def run(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_bound(self, timeout: float = 30) -> None:
        self.run(_until(lambda: bool(self.server.runner.addresses)), timeout)

    @property
    def engine(self) -> AsyncEngine:
        return self.server.engine

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def stop(self) -> None:
        if self._started is not None and not self._started.done():
            self._started.cancel()
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    await asyncio.wait_for(_until(predicate), timeout)


async def read_events(response: aiohttp.ClientResponse) -> list[Any]:
    """Every SSE `data:` payload of a response, JSON-decoded; `[DONE]` stays a string."""
    events = []
    async for line in response.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            data = text[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def greedy(max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    """Request fields for a deterministic run of exactly `max_tokens` tokens."""
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


class ServeProcess:
    """`python -m service.cli serve` on free HTTP and gRPC ports; stderr collected by a thread."""

    def __init__(self, model: Path, *args: str) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", "-m", str(model), "--port", "0", "--grpc-port", "0",
               "--ctx-size", "256", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.port = self.grpc_port = 0
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if match := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
                self.port = int(match.group(1))
            if match := re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", line):
                self.grpc_port = int(match.group(1))
            if "ready: model" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = 60) -> ServeProcess:
        if not self._ready.wait(timeout):
            raise AssertionError("the server did not become ready:\n" + "".join(self.lines))
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        return "".join(self.lines)
