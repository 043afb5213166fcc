"""moecache.v1.Generation over a real grpc.aio channel: token streaming, chat with logprobs,
cancellation, Tokenize, ModelInfo, and the same validation as the HTTP API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from job_servers import ServerThread, engine_config, greedy, grpc_options, grpc_target, poll

from service.grpc_api.stubs import Stubs
from service.openai.limits import Limits


def sampling(stubs: Stubs, **fields: Any) -> Any:
    return stubs.generation_pb2.SamplingParameters(**{"temperature": 0.0, "ignore_eos": True, **fields})


def user_chat(stubs: Stubs, text: str) -> Any:
    pb = stubs.generation_pb2
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=text)])


async def collect(call: Any) -> list[Any]:
    return [response async for response in call]


async def test_generate_streams_the_tokens_then_one_finished_message(
        channel: grpc.aio.Channel, stubs: Stubs, server: ServerThread) -> None:
    stub = stubs.generation_grpc.GenerationStub(channel)
    request = stubs.generation_pb2.GenerateRequest(prompt="Hello", sampling=sampling(stubs, max_tokens=7))
    responses = await collect(stub.Generate(request))
    chunks = [r.chunk for r in responses if r.WhichOneof("event") == "chunk"]
    assert [r.WhichOneof("event") for r in responses][-1] == "finished"
    assert sum(len(c.token_ids) for c in chunks) == 7 and len(responses) == len(chunks) + 1
    finished = responses[-1].finished
    prompt_ids = server.engine.tokenizer.encode("Hello")
    assert finished.finish_reason == "length"
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (len(prompt_ids), 7)
    token_ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == server.engine.tokenizer.decode(token_ids)
    async with aiohttp.ClientSession() as http:  # the HTTP API samples the same greedy tokens
        async with http.post(server.url("/v1/completions"), json=greedy(7, prompt="Hello")) as r:
            assert (await r.json())["choices"][0]["text"] == "".join(c.text for c in chunks)


async def test_chat_with_logprobs_gives_the_top_tokens_of_every_token(channel: grpc.aio.Channel,
                                                                      stubs: Stubs) -> None:
    stub = stubs.generation_grpc.GenerationStub(channel)
    request = stubs.generation_pb2.GenerateRequest(chat=user_chat(stubs, "Hi"),
                                                   sampling=sampling(stubs, max_tokens=4, logprobs=3))
    chunks = [r.chunk for r in await collect(stub.Generate(request)) if r.WhichOneof("event") == "chunk"]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for c in chunks for t in c.token_ids]
    assert all(len(lp.top) == 3 and lp.top[0].token_id == lp.token_id for lp in logprobs)  # greedy: top-1
    assert all(lp.logprob <= 0 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob for lp in logprobs)


async def test_cancelling_the_call_aborts_the_request(channel: grpc.aio.Channel, stubs: Stubs,
                                                      server: ServerThread) -> None:
    stub = stubs.generation_grpc.GenerationStub(channel)
    call = stub.Generate(stubs.generation_pb2.GenerateRequest(prompt="Go", sampling=sampling(stubs, max_tokens=200)))
    seen = 0
    async for response in call:
        seen += len(response.chunk.token_ids)
        if seen >= 3:
            break
    assert server.engine.num_pending == 1
    aborted_before = aborted(server)
    call.cancel()
    await poll(lambda: _async(server.engine.num_pending == 0 and server.engine.num_running == 0), timeout=5)
    assert await call.code() == grpc.StatusCode.CANCELLED
    assert aborted(server) == aborted_before + 1  # aborted, not run to its 200 tokens


def aborted(server: ServerThread) -> float:
    labels = {"model": "tiny", "finished_reason": "abort"}
    value = server.server.metrics.registry.get_sample_value("moecache_request_success_total", labels)
    return value or 0.0


async def _async(value: bool) -> bool:
    return value


async def test_tokenize_and_model_info(channel: grpc.aio.Channel, stubs: Stubs, server: ServerThread) -> None:
    stub, pb = stubs.generation_grpc.GenerationStub(channel), stubs.generation_pb2
    tokenizer = server.engine.tokenizer
    plain = await stub.Tokenize(pb.TokenizeRequest(prompt="Hello world", add_special=False))
    assert list(plain.token_ids) == tokenizer.encode("Hello world", add_special=False)
    chat = await stub.Tokenize(pb.TokenizeRequest(chat=user_chat(stubs, "Hi")))
    messages = [{"role": "user", "content": "Hi"}]
    assert list(chat.token_ids) == tokenizer.encode_chat(messages, True) and chat.max_model_len == 256
    info = await stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.id, info.max_model_len) == ("tiny", 256) and info.created > 0 and info.version


@pytest.mark.parametrize(("fields", "needle"), [
    ({"sampling": {"temperature": -1.0}}, "temperature"),
    ({"sampling": {"max_tokens": 201}}, "max_tokens must be at most 200"),
    ({"sampling": {"top_p": 0.0}}, "top_p"),
    ({"sampling": {"seed": 2**64 - 1}}, "seed"),
    ({"no_input": True}, "give a prompt or a chat"),
    ({"chat": []}, "messages"),
])
async def test_invalid_requests_are_invalid_argument(channel: grpc.aio.Channel, stubs: Stubs,
                                                     fields: dict[str, Any], needle: str) -> None:
    pb = stubs.generation_pb2
    request = pb.GenerateRequest(sampling=sampling(stubs, **fields.get("sampling", {})))
    if "chat" in fields:
        request.chat.CopyFrom(pb.Chat())
    elif "no_input" not in fields:
        request.prompt = "Hello"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stubs.generation_grpc.GenerationStub(channel).Generate(request))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in caught.value.details()


async def test_another_model_is_not_found(channel: grpc.aio.Channel, stubs: Stubs) -> None:
    request = stubs.generation_pb2.GenerateRequest(prompt="Hi", model="gpt-4", sampling=sampling(stubs))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stubs.generation_grpc.GenerationStub(channel).Generate(request))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "gpt-4" in caught.value.details()


async def test_a_full_queue_is_resource_exhausted(tiny_gguf: Path, stubs: Stubs, tmp_path: Path) -> None:
    limits = Limits(max_tokens=200, max_concurrent_requests=1, max_queued_requests=0)
    srv = ServerThread(engine_config(tiny_gguf), grpc_options(tmp_path, limits=limits)).start()
    try:
        async with grpc.aio.insecure_channel(grpc_target(srv)) as channel:
            stub = stubs.generation_grpc.GenerationStub(channel)
            long = stub.Generate(stubs.generation_pb2.GenerateRequest(prompt="a", sampling=sampling(stubs,
                                                                                              max_tokens=200)))
            await long.read()  # the first chunk: it holds the only turn
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub.Generate(stubs.generation_pb2.GenerateRequest(prompt="b", sampling=sampling(stubs))))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "too many requests" in caught.value.details()
            long.cancel()
    finally:
        srv.stop()
