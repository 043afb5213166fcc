"""The servicers of `moecache.v1`: Generation over the AsyncEngine, Jobs over the job store. Handlers
only parse, enqueue and await, as the HTTP handlers do; the Gate interceptor has checked the API key
and readiness before any of them runs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.grpc_api.convert import (
    STUBS,
    chunk_message,
    finished_message,
    gen_pb,
    job_message,
    jobs_pb,
    request_body,
    status_name,
    tokenize_body,
)
from service.grpc_api.errors import streaming, unary
from service.jobs.api import DEFAULT_PAGE
from service.jobs.records import Job
from service.jobs.runtime import Jobs
from service.openai.requests import read_generation, tokenize_request
from service.state import ServerState

GenerationServicer: Any = STUBS.generation_grpc.GenerationServicer
JobsServicer: Any = STUBS.jobs_grpc.JobsServicer


class GenerationService(GenerationServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @streaming
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        arrival = time.perf_counter()
        kind, body = request_body(request)
        generation = await asyncio.to_thread(read_generation, kind, body, self.state.model)
        requests = generation.requests(f"grpc-{uuid.uuid4().hex}", arrival)
        # NOTE: a cancelled call cancels this handler: leaving `open` aborts the request within a step.
        async with self.state.admission.turn(), self.state.engine.open(requests) as stream:
            async for out in stream:
                if out.new_token_ids or out.new_text or out.logprobs:
                    yield chunk_message(out, self.state.tokenizer)
                if out.finished:
                    yield finished_message(out)

    @unary
    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        token_ids = await asyncio.to_thread(tokenize_request, tokenize_body(request), self.state.tokenizer)
        return gen_pb.TokenizeResponse(token_ids=token_ids, max_model_len=self.state.engine.max_model_len)

    @unary
    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        state = self.state
        return gen_pb.ModelInfoResponse(id=state.model_name, created=state.created, version=state.version,
                                        max_model_len=state.engine.max_model_len)


class JobsService(JobsServicer):
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs

    @unary
    async def Submit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        _, body = request_body(request.request)
        return job_message(await self.jobs.submit(body))

    @unary
    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return job_message(await self.jobs.get(request.id))

    @unary
    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        page, has_more = await self.jobs.list(request.limit or DEFAULT_PAGE, request.after or None,
                                              status_name(request.status))
        return jobs_pb.ListJobsResponse(jobs=[job_message(job) for job in page], has_more=has_more)

    @streaming
    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in self.jobs.watch(request.id, request.after_seq):
            if isinstance(item, Job):
                yield jobs_pb.JobEvent(finished=job_message(item))
            else:
                chunk = jobs_pb.JobChunk(seq=item.seq, text=item.text, token_ids=item.token_ids)
                yield jobs_pb.JobEvent(chunk=chunk)

    @unary
    async def Cancel(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return job_message(await self.jobs.cancel(request.id))
