"""Prompt log-probabilities over `/v1/completions`: OpenAI's legacy `echo` + `logprobs` (the request
lm-eval-harness's `local-completions` sends for loglikelihood tasks) through the official `openai`
client, vLLM's `prompt_logprobs` and `return_tokens_as_token_ids`; checked against HF transformers'
log-probabilities of the same tiny model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any

import aiohttp
import pytest
import torch
from http_servers import ServerThread, engine_config
from openai import AsyncOpenAI

from engine.gguf.tokenizer import Tokenizer
from service.server import ServeOptions
from tests.hf_models import tiny_model, write_hf_gguf
from tools.embedded_vocab import build_embedded_vocab

VOCAB = build_embedded_vocab()
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_model("qwen3_moe", seed=5, vocab_size=len(VOCAB["tokenizer.ggml.tokens"]))


@pytest.fixture(scope="module")
def hf_server(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = write_hf_gguf(hf, tmp_path_factory.mktemp("plp") / "hf-tiny.gguf", metadata=VOCAB)
    srv = ServerThread(engine_config(path), ServeOptions(port=0)).start()
    yield srv
    srv.stop()


@pytest.fixture
async def oai(hf_server: ServerThread) -> AsyncIterator[AsyncOpenAI]:
    client = AsyncOpenAI(base_url=hf_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    yield client
    await client.close()


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def loglikelihood(choices: list[Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval-harness's `LocalCompletionsAPI.parse_logprobs`: the continuation's summed logprob (the
    prompt's tokens after the context, before the one generated token) and whether it is greedy."""
    out = []
    for choice, ctxlen in zip(sorted(choices, key=itemgetter("index")), ctxlens, strict=True):
        lps, tops = choice["logprobs"]["token_logprobs"][ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))))
    return out


async def test_lm_eval_loglikelihood_request(oai: AsyncOpenAI, hf: Any) -> None:
    tok = Tokenizer.from_metadata(VOCAB)
    contexts = [tok.encode("The hare laughed at"), tok.encode("Once upon a time")]
    continuations = [tok.encode(" the slow tortoise"), tok.encode(" there was a fox")]
    prompts = [c + x for c, x in zip(contexts, continuations, strict=True)]
    # the payload of lm-eval's _create_payload(generate=False), tokenized requests
    out = await oai.completions.create(model="hf-tiny", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                       seed=1234, echo=True)
    choices = [c.model_dump() for c in out.choices]
    for choice, prompt in zip(choices, prompts, strict=True):
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1 and choice["logprobs"]["token_logprobs"][0] is None
        assert choice["text"].startswith(tok.decode(prompt))
    got = loglikelihood(choices, [len(c) for c in contexts])
    for (total, greedy), context, continuation in zip(got, contexts, continuations, strict=True):
        ids = context + continuation
        ref = hf_logprobs(hf, ids)
        rows = ref[len(context) - 1:len(ids) - 1]
        expected = float(rows[torch.arange(len(continuation)), torch.tensor(continuation)].sum())
        assert abs(total - expected) < TOLERANCE * len(continuation)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(continuation)).all())


async def test_echo_streamed_equals_the_whole_answer(oai: AsyncOpenAI) -> None:
    args: dict[str, Any] = dict(model="hf-tiny", prompt="Once upon a time", temperature=0, max_tokens=4,
                                logprobs=2, echo=True, extra_body={"ignore_eos": True})
    whole = (await oai.completions.create(**args)).choices[0]
    chunks = [c.choices[0] async for c in await oai.completions.create(stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert whole.logprobs is not None
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)] == getattr(whole.logprobs, field)
    assert whole.logprobs.text_offset == sorted(whole.logprobs.text_offset)


async def test_echo_without_logprobs_prefixes_the_prompt(oai: AsyncOpenAI) -> None:
    plain = await oai.completions.create(model="hf-tiny", prompt="Once upon a time", temperature=0, max_tokens=3)
    echoed = await oai.completions.create(model="hf-tiny", prompt="Once upon a time", temperature=0, max_tokens=3,
                                          echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


async def test_tokens_as_token_ids(oai: AsyncOpenAI) -> None:
    prompt = Tokenizer.from_metadata(VOCAB).encode("Hello there")
    out = await oai.completions.create(model="hf-tiny", prompt=prompt, temperature=0, max_tokens=2, logprobs=2,
                                       echo=True, extra_body={"return_tokens_as_token_ids": True})
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs[1:] for key in top)


async def test_vllm_prompt_logprobs_field(oai: AsyncOpenAI, hf: Any) -> None:
    prompt = Tokenizer.from_metadata(VOCAB).encode("The hare laughed")
    out = await oai.completions.create(model="hf-tiny", prompt=prompt, temperature=0, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_dump()["prompt_logprobs"]
    ref = hf_logprobs(hf, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:]):
        own = entry[str(prompt[pos + 1])]
        assert abs(own["logprob"] - float(ref[pos, prompt[pos + 1]])) < TOLERANCE
        top = torch.topk(ref[pos], 2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
])
async def test_refused_with_the_field_named(hf_server: ServerThread, path: str, body: dict[str, Any],
                                            field: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(hf_server.url(path), json=body) as response:
        assert response.status == 400
        assert (await response.json())["error"]["param"] == field
