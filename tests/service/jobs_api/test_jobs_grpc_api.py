"""moecache.v1.Jobs over a real grpc.aio channel, on SQLite and on PostgreSQL: submit, watch from the
start and resumed from an offset, get, list, cancel, and the status codes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from job_servers import ServerThread

from service.grpc_api.stubs import Stubs


@pytest.fixture
async def jobs(server: ServerThread, stubs: Stubs) -> AsyncIterator[Any]:
    assert server.server.grpc is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc.port}") as channel:
        yield stubs.jobs_grpc.JobsStub(channel)


def generate(stubs: Stubs, max_tokens: int, prompt: str = "Hello") -> Any:
    pb = stubs.generation_pb2
    sampling = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(prompt=prompt, sampling=sampling)


async def watch(jobs: Any, stubs: Stubs, job_id: str, after_seq: int = 0) -> list[Any]:
    return [event async for event in jobs.Watch(stubs.jobs_pb2.WatchJobRequest(id=job_id, after_seq=after_seq))]


async def test_submit_then_watch_from_the_start_and_from_an_offset(jobs: Any, stubs: Stubs) -> None:
    pb = stubs.jobs_pb2
    job = await jobs.Submit(pb.SubmitJobRequest(request=generate(stubs, 30)))
    assert job.status == pb.JOB_STATUS_QUEUED and job.kind == "completion"
    events = await watch(jobs, stubs, job.id)
    chunks, finished = [e.chunk for e in events[:-1]], events[-1].finished
    assert events[-1].WhichOneof("event") == "finished" and finished.status == pb.JOB_STATUS_SUCCEEDED
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1)) and len(chunks) >= 3
    assert "".join(c.text for c in chunks) == finished.text and sum(len(c.token_ids) for c in chunks) == 30
    assert (finished.finish_reason, finished.usage.completion_tokens, finished.progress_tokens) == ("length", 30, 30)
    assert finished.HasField("started_at") and finished.HasField("finished_at") and finished.attempts == 1
    resumed = await watch(jobs, stubs, job.id, after_seq=2)
    assert [e.chunk.seq for e in resumed[:-1]] == [c.seq for c in chunks[2:]]
    assert "".join(e.chunk.text for e in resumed[:-1]) == "".join(c.text for c in chunks[2:])
    got = await jobs.Get(pb.GetJobRequest(id=job.id))
    assert got.result_json and got.text == finished.text and got.status == pb.JOB_STATUS_SUCCEEDED


async def test_list_filters_by_status(jobs: Any, stubs: Stubs) -> None:
    pb = stubs.jobs_pb2
    submitted = [await jobs.Submit(pb.SubmitJobRequest(request=generate(stubs, 2, f"p{i}"))) for i in range(3)]
    for job in submitted:
        await watch(jobs, stubs, job.id)
    page = await jobs.List(pb.ListJobsRequest(limit=2))
    assert [j.id for j in page.jobs] == [submitted[2].id, submitted[1].id] and page.has_more
    rest = await jobs.List(pb.ListJobsRequest(limit=1, after=page.jobs[-1].id))
    assert [j.id for j in rest.jobs] == [submitted[0].id]
    succeeded = await jobs.List(pb.ListJobsRequest(limit=100, status=pb.JOB_STATUS_SUCCEEDED))
    assert {j.id for j in submitted} <= {j.id for j in succeeded.jobs}
    assert all(j.status == pb.JOB_STATUS_SUCCEEDED for j in succeeded.jobs)


async def test_cancel_ends_the_watch_with_the_cancelled_job(jobs: Any, stubs: Stubs) -> None:
    pb = stubs.jobs_pb2
    job = await jobs.Submit(pb.SubmitJobRequest(request=generate(stubs, 200)))
    stream = jobs.Watch(pb.WatchJobRequest(id=job.id))
    first = await stream.read()
    assert first.chunk.seq == 1
    assert (await jobs.Cancel(pb.CancelJobRequest(id=job.id))).cancel_requested
    rest = [first]
    while (event := await stream.read()) is not grpc.aio.EOF:
        rest.append(event)
    assert rest[-1].finished.status == pb.JOB_STATUS_CANCELLED and rest[-1].finished.progress_tokens < 200


async def test_status_codes(jobs: Any, stubs: Stubs) -> None:
    pb = stubs.jobs_pb2
    for call in (jobs.Get(pb.GetJobRequest(id="job_missing")), jobs.Cancel(pb.CancelJobRequest(id="job_missing")),
                 watch(jobs, stubs, "job_missing")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "job_missing" in caught.value.details()
    bad = generate(stubs, 4)
    bad.sampling.logprobs = 2
    for request in (bad, stubs.generation_pb2.GenerateRequest()):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.Submit(pb.SubmitJobRequest(request=request))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs.List(pb.ListJobsRequest(limit=101))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in caught.value.details()
