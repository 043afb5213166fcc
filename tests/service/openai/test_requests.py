"""Prompt log-probabilities in the shared protocol: `echo`, `logprobs`, vLLM's `prompt_logprobs` and
`return_tokens_as_token_ids` read once for HTTP, gRPC and jobs; where they cannot apply, a 400 naming the field."""

from __future__ import annotations

from typing import Any, cast

import pytest

from engine.gguf.tokenizer import Tokenizer
from engine.types import RequestError
from service.jobs.api import check_job
from service.openai.errors import ApiError, from_exception
from service.openai.limits import Limits
from service.openai.requests import Generation, ServedModel, read_generation


class IdTokenizer:
    """Enough of a tokenizer for prompts given as token ids."""

    vocab_size = 100


MODEL = ServedModel("tiny", cast(Tokenizer, IdTokenizer()), max_model_len=64, limits=Limits())
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def completion(**fields: Any) -> Generation:
    return read_generation("completion", {"prompt": [1, 2, 3], "max_tokens": 2, **fields}, MODEL)


def refused_param(read: Any) -> str | None:
    """The field named by the 400 that every transport answers (`from_exception`)."""
    with pytest.raises((ApiError, RequestError)) as error:
        read()
    answer = from_exception(error.value)
    assert answer.status == 400
    return answer.param


def test_echo_with_logprobs_asks_the_engine_for_the_prompt_logprobs_too() -> None:
    job = completion(echo=True, logprobs=3)
    assert job.echo and (job.params.logprobs, job.params.prompt_logprobs) == (3, 3)


def test_echo_alone_asks_for_no_logprobs() -> None:
    job = completion(echo=True)
    assert job.echo and job.params.logprobs is None and job.params.prompt_logprobs is None


def test_prompt_logprobs_and_token_ids_are_read_without_echo() -> None:
    job = completion(prompt_logprobs=2, return_tokens_as_token_ids=True)
    assert (job.echo, job.tokens_as_ids, job.params.prompt_logprobs, job.params.logprobs) == (False, True, 2, None)


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
])
def test_a_bad_prompt_logprobs_request_names_its_field(fields: dict[str, Any], param: str) -> None:
    assert refused_param(lambda: completion(**fields)) == param


@pytest.mark.parametrize("name", ["echo", "prompt_logprobs"])
def test_chat_refuses_what_is_for_prompts(name: str) -> None:
    assert refused_param(lambda: read_generation("chat", {**CHAT, name: 1}, MODEL)) == name


@pytest.mark.parametrize(("fields", "param"), [({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "logprobs")])
def test_a_job_refuses_what_it_cannot_keep(fields: dict[str, Any], param: str) -> None:
    body = {"prompt": [1, 2], "max_tokens": 2, **fields}
    assert refused_param(lambda: check_job("completion", body, MODEL)) == param
