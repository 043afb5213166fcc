"""Typed objects at the engine's boundaries: requests in, scheduler output, per-request output."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestError(ValueError):
    """A request the engine cannot run; `param` names the offending field (OpenAI's error object)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's logprob and the n most likely
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob and the n most likely

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(self.stop), "stop strings must not be empty"),
        ]
        for name, ok, message in checks:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise RequestError(f"{name} {message} (got {value!r})", param=name)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    slot: int  # KV-cache slot
    start: int  # position of the first token in this chunk
    token_ids: tuple[int, ...]  # a prompt chunk, or the last sampled token when decoding
    samples: bool  # the chunk reaches the end of the known tokens: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    finished_ids: tuple[str, ...] = ()  # aborted or finished since the last step; their slots are free

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, TokenLogprob]
    num_tokens: int  # tokens the forward pass computed
    seconds: float
    # request id -> the log-probabilities of the prompt tokens this step's chunk predicted, in order
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (an increment, not the whole text)."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    error: str | None = None
    # in the first output of a request that asked: one per prompt token, None for the first (no context)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same request as one increment."""
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text, logprobs=self.logprobs + later.logprobs,
                       prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs, error=later.error or self.error)
