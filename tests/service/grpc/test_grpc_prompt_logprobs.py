"""`sampling.prompt_logprobs` over gRPC: the prompt tokens' logprobs in the first chunk, the same values
the HTTP API gives for the same prompt."""

from __future__ import annotations

import aiohttp
import grpc
from job_servers import ServerThread

from service.grpc_api.stubs import Stubs

PROMPT = "The hare laughed at the slow tortoise"


async def test_prompt_logprobs_come_in_the_first_chunk(channel: grpc.aio.Channel, stubs: Stubs,
                                                       server: ServerThread) -> None:
    stub = stubs.generation_grpc.GenerationStub(channel)
    sampling = stubs.generation_pb2.SamplingParameters(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                       prompt_logprobs=2)
    request = stubs.generation_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling)
    chunks = [r.chunk async for r in stub.Generate(request) if r.WhichOneof("event") == "chunk"]
    prompt = server.engine.tokenizer.encode(PROMPT)
    first, *rest = chunks
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]  # nothing precedes the first
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in first.prompt_logprobs)
    assert all(not c.prompt_logprobs for c in rest)
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    async with aiohttp.ClientSession() as http, http.post(server.url("/v1/completions"), json=body) as response:
        echoed = (await response.json())["choices"][0]["logprobs"]["token_logprobs"][1:len(prompt)]
    assert [lp.logprob for lp in first.prompt_logprobs] == echoed
