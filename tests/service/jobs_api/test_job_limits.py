"""Job limits and metrics on a server with one job at a time, one queued job and 1 KiB files:
429 / RESOURCE_EXHAUSTED for a full queue, 413 for a large upload, `moecache_jobs` and
`moecache_job_latency_seconds` on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from job_servers import ServerThread, engine_config, get_json, greedy, job_options, wait_job

from service.grpc_api.stubs import Stubs
from service.openai.limits import Limits
from service.server import ServeOptions


@pytest.fixture(scope="module")
def small_server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    store_url = f"sqlite:///{tmp_path_factory.mktemp('limits') / 'jobs.db'}"
    jobs = job_options(store_url, concurrency=1, max_queued_jobs=1, max_file_bytes=1024)
    srv = ServerThread(engine_config(tiny_gguf), ServeOptions(port=0, grpc_port=0, limits=Limits(max_tokens=200),
                                                              jobs=jobs)).start()
    yield srv
    srv.stop()


async def post_job(http: aiohttp.ClientSession, srv: ServerThread, max_tokens: int) -> tuple[int, dict]:
    async with http.post(srv.url("/v1/jobs"), json=greedy(max_tokens, prompt="x")) as r:
        return r.status, await r.json()


async def test_a_full_queue_is_429_and_resource_exhausted(http: aiohttp.ClientSession, small_server: ServerThread,
                                                          stubs: Stubs) -> None:
    status, running = await post_job(http, small_server, 200)
    await wait_job(http, small_server.base_url, running["id"], until=lambda j: j["status"] == "running")
    status, queued = await post_job(http, small_server, 200)  # the one place in the queue
    assert status == 202 and queued["status"] == "queued"
    status, refused = await post_job(http, small_server, 2)
    assert status == 429 and refused["error"]["code"] == "too_many_jobs"
    assert small_server.server.grpc is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{small_server.server.grpc.port}") as channel:
        request = stubs.generation_pb2.GenerateRequest(prompt="x")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stubs.jobs_grpc.JobsStub(channel).Submit(stubs.jobs_pb2.SubmitJobRequest(request=request))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for job in (queued, running):
        async with http.delete(small_server.url(f"/v1/jobs/{job['id']}")) as r:
            assert r.status == 200
        assert (await wait_job(http, small_server.base_url, job["id"]))["status"] == "cancelled"


async def test_a_large_upload_is_413_and_only_batch_files_are_taken(http: aiohttp.ClientSession,
                                                                    small_server: ServerThread) -> None:
    for data, purpose, status in ((b"x" * 1025, "batch", 413), (b"{}\n", "fine-tune", 400), (b"{}\n", "batch", 200)):
        form = aiohttp.FormData()
        form.add_field("purpose", purpose)
        form.add_field("file", data, filename="in.jsonl")
        async with http.post(small_server.url("/v1/files"), data=form) as r:
            assert r.status == status, await r.text()
            if status == 413:
                assert (await r.json())["error"]["code"] == "file_too_large"


async def test_metrics_count_jobs_by_state_and_their_latency(http: aiohttp.ClientSession,
                                                             small_server: ServerThread) -> None:
    status, job = await post_job(http, small_server, 3)
    assert (await wait_job(http, small_server.base_url, job["id"]))["status"] == "succeeded"
    async with http.get(small_server.url("/metrics")) as r:
        text = await r.text()
    jobs = await get_json(http, small_server.url("/v1/jobs?limit=100"))
    by_state = {state: sum(j["status"] == state for j in jobs["data"]) for state in ("succeeded", "cancelled")}
    for state, count in by_state.items():
        assert f'moecache_jobs{{model="tiny",state="{state}"}} {float(count)}' in text
    assert 'moecache_jobs{model="tiny",state="queued"} 0.0' in text
    # a worker observes the jobs it finished; a job cancelled while queued never had one
    finished = sum(j["started_at"] is not None and j["status"] in by_state for j in jobs["data"])
    assert f'moecache_job_latency_seconds_count{{model="tiny"}} {float(finished)}' in text
