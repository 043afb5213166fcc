"""Response objects exactly as OpenAI writes them: completions, chat completions, their stream chunks,
logprobs and usage."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.gguf.tokenizer import Tokenizer
from engine.types import RequestOutput, TokenLogprob
from service.openai.requests import Generation

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares."""

    id: str
    created: int
    model: str
    fingerprint: str

    def wrap(self, obj: str, **fields: Any) -> JsonObject:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, **fields}


@dataclass
class Choice:
    """One choice as it accumulates over the outputs of its request."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_generated_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs.extend(out.logprobs)
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_generated_tokens = out.num_generated_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> JsonObject:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionFormat:
    """`/v1/completions`: `text_completion` objects with the legacy logprobs layout. With `echo` the prompt
    comes first: its text, and with logprobs its tokens (the first without a logprob, as OpenAI and vLLM
    give it)."""

    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, with_logprobs: bool) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs
        self._offsets: dict[int, int] = {}  # choice -> characters of the token texts sent so far
        self.echo_prompts: list[tuple[int, ...]] = []  # per choice, while its prompt is still to be sent
        self.tokens_as_ids = False
        self.with_prompt_logprobs = False  # vLLM's `prompt_logprobs` field in each choice

    @classmethod
    def for_job(cls, tokenizer: Tokenizer, job: Generation) -> CompletionFormat:
        fmt = cls(tokenizer, job.params.logprobs is not None)
        fmt.echo_prompts = [p for p in job.prompts for _ in range(job.n)] if job.echo else []
        fmt.tokens_as_ids = job.tokens_as_ids
        fmt.with_prompt_logprobs = job.params.prompt_logprobs is not None and not job.echo
        return fmt

    def choice(self, c: Choice) -> JsonObject:
        logprobs = self.logprobs(c.index, c.logprobs, c.prompt_logprobs)  # before the echo is marked sent
        out = {"index": c.index, "text": self._echo_text(c.index) + "".join(c.text), "logprobs": logprobs,
               "finish_reason": c.finish_reason}
        return out | {"prompt_logprobs": self._vllm_prompt_logprobs(c.prompt_logprobs)} \
            if self.with_prompt_logprobs else out

    def first_delta(self, index: int) -> JsonObject | None:
        return None  # completions streams start with text

    def delta(self, index: int, text: str, lps: Sequence[TokenLogprob],
              prompt_lps: Sequence[TokenLogprob | None] = ()) -> JsonObject:
        logprobs = self.logprobs(index, lps, prompt_lps)  # before the echo is marked sent
        return {"index": index, "text": self._echo_text(index) + text, "logprobs": logprobs, "finish_reason": None}

    def finish(self, index: int, reason: str) -> JsonObject:
        return {"index": index, "text": self._echo_text(index), "logprobs": None, "finish_reason": reason}

    def logprobs(self, index: int, lps: Sequence[TokenLogprob],
                 prompt_lps: Sequence[TokenLogprob | None] = ()) -> JsonObject | None:
        """text_offset: where each token's text starts in the completion, counted over token texts."""
        if not self.with_logprobs:
            return None
        entries = [*self._echo_entries(index, prompt_lps), *((lp.token_id, lp) for lp in lps)]
        tokens = [self._name(token_id) for token_id, _ in entries]
        starts = list(itertools.accumulate((len(t) for t in tokens), initial=self._offsets.get(index, 0)))
        self._offsets[index] = starts.pop()
        top = [None if lp is None else {self._name(t): v for t, v in lp.top} for _, lp in entries]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
                "top_logprobs": top, "text_offset": starts}

    def _echo_entries(self, index: int,
                      prompt_lps: Sequence[TokenLogprob | None]) -> list[tuple[int, TokenLogprob | None]]:
        if index >= len(self.echo_prompts) or not self.echo_prompts[index]:
            return []
        prompt = self.echo_prompts[index]
        return list(zip(prompt, prompt_lps or [None] * len(prompt), strict=True))

    def _echo_text(self, index: int) -> str:
        """The prompt's text the first time a choice sends anything, then ""."""
        if index >= len(self.echo_prompts) or not self.echo_prompts[index]:
            return ""
        prompt, self.echo_prompts[index] = self.echo_prompts[index], ()
        return self.tokenizer.decode(prompt)

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self.tokenizer.token_text(token_id)

    def _vllm_prompt_logprobs(self, lps: Sequence[TokenLogprob | None]) -> list[JsonObject | None]:
        """vLLM's layout: per prompt token, its own and the most likely tokens by id, with their rank."""
        def entry(lp: TokenLogprob) -> JsonObject:
            ranks = {t: rank for rank, (t, _) in enumerate(lp.top, start=1)}
            own = {str(lp.token_id): {"logprob": lp.logprob, "rank": ranks.get(lp.token_id),
                                      "decoded_token": self._name(lp.token_id)}}
            return own | {str(t): {"logprob": v, "rank": ranks[t], "decoded_token": self._name(t)} for t, v in lp.top}
        return [None if lp is None else entry(lp) for lp in lps]


class ChatFormat:
    """`/v1/chat/completions`: assistant messages, deltas, and the `content` logprobs layout."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, with_logprobs: bool) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs

    def choice(self, c: Choice) -> JsonObject:
        message = {"role": "assistant", "content": "".join(c.text), "refusal": None}
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c.index, c.logprobs),
                "finish_reason": c.finish_reason}

    def first_delta(self, index: int) -> JsonObject | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, text: str, lps: Sequence[TokenLogprob],
              prompt_lps: Sequence[TokenLogprob | None] = ()) -> JsonObject:
        return {"index": index, "delta": {"content": text}, "logprobs": self.logprobs(index, lps),
                "finish_reason": None}

    def finish(self, index: int, reason: str) -> JsonObject:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> JsonObject | None:
        if not self.with_logprobs:
            return None
        return {"content": [self._token(lp.token_id, lp.logprob) | {"top_logprobs": [
            self._token(t, v) for t, v in lp.top]} for lp in lps], "refusal": None}

    def _token(self, token_id: int, logprob: float) -> JsonObject:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


Format = CompletionFormat | ChatFormat
