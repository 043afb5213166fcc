"""Helpers of the gRPC and job API tests: real servers with a job store and a gRPC port, in process
(`ServerThread` from the HTTP tests) or as `python -m service.cli serve` subprocesses, and polling."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from service.jobs.run import WorkerOptions
from service.jobs.runtime import JobOptions
from service.openai.limits import Limits
from service.server import ServeOptions

ROOT = Path(__file__).resolve().parents[2]
HTTP_TESTS = Path(__file__).resolve().parent / "http"
sys.path.insert(0, str(HTTP_TESTS))
from http_servers import ServeProcess as HttpServeProcess  # noqa: E402
from http_servers import ServerThread, engine_config, greedy  # noqa: E402

__all__ = ["ROOT", "ServeProcess", "ServerThread", "engine_config", "greedy", "grpc_options", "grpc_target",
           "job_options", "on_server", "poll", "wait_job"]

FINISHED = ("succeeded", "failed", "cancelled")


def job_options(store_url: str, concurrency: int = 2, **extra: Any) -> JobOptions:
    """Fast polls and a short lease, so the tests need not wait."""
    return JobOptions(store_url, WorkerOptions(concurrency=concurrency, poll_s=0.1, lease_s=5.0), **extra)


def grpc_options(tmp: Path, **extra: Any) -> ServeOptions:
    """Any free HTTP and gRPC ports, a SQLite job store under `tmp`, max_tokens up to 200."""
    fields: dict[str, Any] = {"port": 0, "grpc_port": 0, "jobs": job_options(f"sqlite:///{tmp / 'jobs.db'}"),
                              "limits": Limits(max_tokens=200), **extra}
    return ServeOptions(**fields)


def grpc_target(srv: ServerThread) -> str:
    assert srv.server.grpc is not None
    return f"127.0.0.1:{srv.server.grpc.port}"


class ServeProcess(HttpServeProcess):
    """`moecache serve` as a subprocess with a job store."""

    def __init__(self, model: Path, jobs_db: str, *args: str) -> None:
        super().__init__(model, "--jobs-db", jobs_db, *args)

    @property
    def worker_id(self) -> str:
        match = re.search(r"job worker (\S+):", self.log())
        assert match, "the job worker did not start:\n" + self.log()
        return match.group(1)

    def kill(self) -> None:
        """SIGKILL: no drain, no flush, nothing the process could still write."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)



async def on_server(srv: ServerThread, coro: Awaitable[Any]) -> Any:
    """Run a coroutine on the server's loop without blocking this one (a blocked loop stalls the
    grpc.aio streams it holds)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, srv.loop))  # type: ignore[arg-type]


async def poll(check: Callable[[], Awaitable[Any]], timeout: float = 60, every: float = 0.05) -> Any:
    """Call `check` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s (last: {value!r})")
        await asyncio.sleep(every)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def wait_job(http: aiohttp.ClientSession, base_url: str, job_id: str, timeout: float = 60,
                   until: Callable[[dict[str, Any]], bool] = lambda job: job["status"] in FINISHED) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        job = await get_json(http, f"{base_url}/v1/jobs/{job_id}")
        return job if until(job) else None

    result: dict[str, Any] = await poll(check, timeout)
    return result
