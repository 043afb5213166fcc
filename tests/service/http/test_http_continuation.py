"""`/v1/completions` text continues its prompt on a SentencePiece model: the first generated token keeps
its leading space, streamed and not (the text equals `decode(prompt + output)[len(decode(prompt)):]`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from http_servers import ServerThread, engine_config
from openai import AsyncOpenAI

from service.server import ServeOptions
from tests.engine_runs import greedy_continuation

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def spm_server(spm_gguf: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(spm_gguf), ServeOptions(port=0)).start()
    yield srv
    srv.stop()


@pytest.fixture
async def spm_client(spm_server: ServerThread) -> AsyncIterator[AsyncOpenAI]:
    oai = AsyncOpenAI(base_url=spm_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    yield oai
    await oai.close()


async def test_completion_keeps_the_first_space(spm_client: AsyncOpenAI, spm_gguf: Path) -> None:
    expected = greedy_continuation(spm_gguf, PROMPT, 6)
    model = (await spm_client.models.list()).data[0].id
    args = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = await spm_client.completions.create(**args)
    stream = await spm_client.completions.create(stream=True, **args)
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert whole.choices[0].text == streamed == expected
    assert expected.startswith(" ")
