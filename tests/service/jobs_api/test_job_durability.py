"""Durability with real server processes: a server killed with SIGKILL mid-job and restarted on the
same store resumes every queued and running job (a running one continues from its persisted text),
and two servers sharing one PostgreSQL database finish 50 jobs with none lost and none run twice,
even when one of them is killed halfway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from job_servers import ServeProcess, greedy, poll, wait_job
from pg_server import PostgresServer

from service.jobs import Job, JobStore, open_store

LEASE = ("--job-lease", "2")


@pytest.fixture
def processes() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for process in started:
        process.kill()


def start(processes: list[ServeProcess], model: Path, jobs_db: str, *args: str) -> ServeProcess:
    process = ServeProcess(model, jobs_db, *LEASE, *args)
    processes.append(process)
    return process


async def submit(http: aiohttp.ClientSession, process: ServeProcess, body: dict[str, Any]) -> str:
    async with http.post(process.url("/v1/jobs"), json=body) as r:
        assert r.status == 202, await r.text()
        job_id: str = (await r.json())["id"]
        return job_id


def stored(store_url: str, job_id: str) -> Job:
    with open_store(store_url) as store:
        job = store.get(job_id)
    assert job is not None
    return job


def assert_chunks_match(store: JobStore, job: Job) -> None:
    """Gap-free chunks across attempts, whose text and tokens are exactly the job's."""
    events = store.events(job.id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert "".join(e.text for e in events) == job.text
    assert sum(len(e.token_ids) for e in events) == job.progress_tokens


async def test_a_killed_server_resumes_its_jobs_after_a_restart(tiny_gguf: Path, tmp_path: Path,
                                                                processes: list[ServeProcess]) -> None:
    store_url = f"sqlite:///{tmp_path / 'jobs.db'}"
    first = start(processes, tiny_gguf, store_url, "--job-concurrency", "1").wait_ready()
    async with aiohttp.ClientSession() as http:
        finished_id = await submit(http, first, greedy(3, prompt="short"))
        finished = await wait_job(http, first.url(""), finished_id)
        long_id = await submit(http, first, greedy(240, prompt="long"))
        queued_id = await submit(http, first, greedy(4, prompt="waits"))  # one job at a time: it waits
        await wait_job(http, first.url(""), long_id, until=lambda job: job["progress_tokens"] > 0, timeout=30)
        first.kill()
        before = stored(store_url, long_id)
        assert before.status == "running" and 0 < before.progress_tokens < 240 and before.text
        assert stored(store_url, queued_id).status == "queued"
        second = start(processes, tiny_gguf, store_url).wait_ready()
        resumed = await wait_job(http, second.url(""), long_id)
        assert (await wait_job(http, second.url(""), queued_id))["status"] == "succeeded"
        assert await wait_job(http, second.url(""), finished_id) == finished  # kept as it was
    assert resumed["status"] == "succeeded" and resumed["attempts"] == 2
    assert resumed["text"].startswith(before.text) and len(resumed["text"]) > len(before.text)
    assert resumed["progress_tokens"] == 240 and resumed["result"]["usage"]["completion_tokens"] == 240
    assert resumed["result"]["choices"][0]["text"] == resumed["text"]
    with open_store(store_url) as store:
        assert_chunks_match(store, stored(store_url, long_id))


async def test_two_servers_on_one_postgres_finish_50_jobs_once_each(
        tiny_gguf: Path, postgres_server: PostgresServer, processes: list[ServeProcess]) -> None:
    store_url = postgres_server.create_schema()
    try:
        await run_50_jobs_on_two_servers(tiny_gguf, store_url, processes)
    finally:
        postgres_server.drop_schema(store_url)


async def run_50_jobs_on_two_servers(model: Path, store_url: str, processes: list[ServeProcess]) -> None:
    a, b = (start(processes, model, store_url, "--job-concurrency", "4") for _ in range(2))
    a.wait_ready()
    b.wait_ready()
    async with aiohttp.ClientSession() as http:
        ids = [await submit(http, (a, b)[i % 2], greedy(JOB_TOKENS, prompt=f"job {i}")) for i in range(50)]
        with open_store(store_url) as store:
            await poll(lambda: _a_is_midway(store, a.worker_id), timeout=60, every=0.01)
        a.kill()
        for job_id in ids:
            await wait_job(http, b.url(""), job_id, timeout=90)
    with open_store(store_url) as store:
        jobs = [store.get(job_id) for job_id in ids]
        assert all(job is not None and job.status == "succeeded" for job in jobs), [j and j.status for j in jobs]
        finished = [job for job in jobs if job is not None]
        for job in finished:
            assert job.progress_tokens == JOB_TOKENS and job.result is not None  # a second run would have appended more
            assert job.result["usage"]["completion_tokens"] == JOB_TOKENS
            assert job.result["choices"][0]["text"] == job.text
            assert_chunks_match(store, job)
    assert {job.worker_id for job in finished} == {a.worker_id, b.worker_id}
    assert any(job.attempts == 2 and job.worker_id == b.worker_id for job in finished)  # reclaimed from a


# NOTE: the kill comes a poll after the store showed a job of the first server at most 16 tokens in: the other 48
# tokens are its margin (with 40 a loaded machine once finished every such job in between, and none was reclaimed)
JOB_TOKENS = 64


async def _a_is_midway(store: JobStore, worker_id: str) -> bool:
    """Some jobs finished, and `worker_id` runs one that is far from done."""
    jobs = store.list(limit=100)
    succeeded = sum(job.status == "succeeded" for job in jobs)
    return succeeded >= 10 and any(job.status == "running" and job.worker_id == worker_id and
                                   0 < job.progress_tokens <= 16 for job in jobs)
