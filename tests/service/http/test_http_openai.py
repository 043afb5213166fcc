"""The OpenAI API through the official `openai` client against a real server: completions and chat,
streaming and not, usage, finish reasons, n, logprobs, stop strings, seeds."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from http_servers import MODEL, ServerThread
from openai import AsyncOpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


async def complete(client: AsyncOpenAI, prompt: str | list[Any] = "Once upon a time", **kw: Any) -> Completion:
    return await client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw})


async def stream_completion(client: AsyncOpenAI, prompt: str | list[Any] = "Once upon a time",
                            **kw: Any) -> tuple[dict[int, str], list[Completion]]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **{**GREEDY, **kw})
    chunks = [c async for c in stream]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


async def chat(client: AsyncOpenAI, **kw: Any) -> ChatCompletion:
    return await client.chat.completions.create(model=MODEL, messages=MESSAGES, **{**GREEDY, **kw})


async def stream_chat(client: AsyncOpenAI, **kw: Any) -> list[ChatCompletionChunk]:
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **{**GREEDY, **kw})
    return [c async for c in stream]


async def test_completion_object_and_usage(client: AsyncOpenAI) -> None:
    out = await complete(client, user="someone")
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    assert out.system_fingerprint and out.created > 0
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6 and out.usage.prompt_tokens > 0


async def test_streamed_completion_equals_the_whole_one(client: AsyncOpenAI) -> None:
    whole = await complete(client, max_tokens=8)
    texts, chunks = await stream_completion(client, max_tokens=8, stream_options={"include_usage": True})
    assert texts[0] == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8 and all(c.usage is None for c in chunks[:-1])


async def test_chat_completion_and_its_stream_agree(client: AsyncOpenAI) -> None:
    whole = await chat(client, max_completion_tokens=7)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 7
    chunks = await stream_chat(client, max_completion_tokens=7)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert not any(c.choices[0].finish_reason for c in chunks[:-1])


async def test_chat_prompt_uses_the_models_template(client: AsyncOpenAI, server: ServerThread) -> None:
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    expected = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special=False, parse_special=True)
    out = await chat(client, max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens == len(expected)


async def test_n_choices_and_a_list_of_prompts(client: AsyncOpenAI) -> None:
    out = await complete(client, prompt=["Hello", "The sky is"], n=2, seed=5, temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 4 * 6
    texts, _ = await stream_completion(client, prompt=["Hello", "The sky is"], n=2, seed=5, temperature=1.0)
    assert texts == {c.index: c.text for c in out.choices}


async def test_token_id_prompts(client: AsyncOpenAI, server: ServerThread) -> None:
    assert server.engine.tokenizer is not None
    ids = server.engine.tokenizer.encode("Once upon a time")
    assert (await complete(client, prompt=ids)).choices[0].text == (await complete(client)).choices[0].text


async def test_seed_gives_the_same_text_and_another_seed_another(client: AsyncOpenAI) -> None:
    runs = await asyncio.gather(*(complete(client, temperature=1.0, seed=s, max_tokens=10) for s in (3, 3, 4)))
    a, b, c = (r.choices[0].text for r in runs)
    assert a == b and a != c


async def test_completion_logprobs_shape(client: AsyncOpenAI) -> None:
    out = await complete(client, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(top) == 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert "".join(lp.tokens) == out.choices[0].text


async def test_chat_logprobs_shape(client: AsyncOpenAI) -> None:
    out = await chat(client, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert bytes(item.bytes or []).decode("utf-8", "replace") == item.token
    assert (await chat(client)).choices[0].logprobs is None


async def test_stop_string_ends_the_text_before_it(client: AsyncOpenAI) -> None:
    text = (await complete(client, max_tokens=12)).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = await complete(client, max_tokens=12, stop=[stop, "never appears"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]
    streamed, _ = await stream_completion(client, max_tokens=12, stop=stop)
    assert streamed[0] == out.choices[0].text


async def test_models_and_public_info(client: AsyncOpenAI, http: aiohttp.ClientSession,
                                      server: ServerThread) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "moecache"
    assert (await client.models.retrieve(MODEL)).id == MODEL
    async with http.get(server.url("/version")) as r:
        assert r.status == 200 and (await r.json())["version"]
    async with http.get(server.url("/health")) as r:
        assert r.status == 200 and (await r.json()) == {"status": "ok"}


async def test_tokenize_and_detokenize(http: aiohttp.ClientSession, server: ServerThread) -> None:
    async with http.post(server.url("/tokenize"), json={"prompt": "Hello world"}) as r:
        body = await r.json()
    assert r.status == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
    async with http.post(server.url("/detokenize"), json={"tokens": body["tokens"]}) as r:
        assert (await r.json())["prompt"] == "Hello world"
    async with http.post(server.url("/tokenize"), json={"messages": MESSAGES}) as r:
        chat_tokens = (await r.json())["tokens"]
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None and chat_tokens == tokenizer.encode_chat(MESSAGES)
