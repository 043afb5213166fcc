"""`moecache serve` as a real process: SIGTERM drains (503 for newcomers, the running stream ends with
its last chunk and `[DONE]`), the engine closes with its cache summary, and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from http_servers import ServeProcess, greedy, read_events

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def serve_process(tiny_gguf: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    process = ServeProcess(tiny_gguf, "--max-num-seqs", "4", "--shutdown-timeout", "1",
                           "--jobs-db", f"sqlite:///{tmp_path / 'jobs.db'}")
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
    log = serve_process.log()
    assert "experts:" in log and "expert cache, batches" in log and "stopped" in log
