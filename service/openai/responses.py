"""Response objects exactly as OpenAI writes them: completions, chat completions, their stream chunks,
logprobs and usage."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.gguf.tokenizer import Tokenizer
from engine.types import RequestOutput, TokenLogprob

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

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_generated_tokens = out.num_generated_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> JsonObject:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionFormat:
    """`/v1/completions`: `text_completion` objects with the legacy logprobs layout."""

    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, with_logprobs: bool) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs
        self._offsets: dict[int, int] = {}  # choice -> characters of the token texts sent so far

    def choice(self, c: Choice) -> JsonObject:
        return {"index": c.index, "text": "".join(c.text), "logprobs": self.logprobs(c.index, c.logprobs),
                "finish_reason": c.finish_reason}

    def first_delta(self, index: int) -> JsonObject | None:
        return None  # completions streams start with text

    def delta(self, index: int, text: str, lps: Sequence[TokenLogprob]) -> JsonObject:
        return {"index": index, "text": text, "logprobs": self.logprobs(index, lps), "finish_reason": None}

    def finish(self, index: int, reason: str) -> JsonObject:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> JsonObject | None:
        """text_offset: where each token's text starts in the completion, counted over token texts."""
        if not self.with_logprobs:
            return None
        tokens = [self.tokenizer.token_text(lp.token_id) for lp in lps]
        starts = list(itertools.accumulate((len(t) for t in tokens), initial=self._offsets.get(index, 0)))
        self._offsets[index] = starts.pop()
        top = [{self.tokenizer.token_text(t): v for t, v in lp.top} for lp in lps]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
                "text_offset": starts}


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

    def delta(self, index: int, text: str, lps: Sequence[TokenLogprob]) -> JsonObject:
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
