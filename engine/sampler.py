"""Logits -> tokens: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.types import SamplingParams, TokenLogprob


@dataclass
class SamplingState:
    """What the sampler needs of one request besides its logits."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_penalties(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """One row `[vocab]`. Repetition penalty over prompt and output (llama.cpp/HF style); presence and
    frequency penalties over the output only (OpenAI semantics)."""
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.prompt_ids) | set(state.output_ids)), dtype=torch.long,
                            device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_ids:
        ids, counts = torch.tensor(list(state.output_ids), device=logits.device).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row `[vocab]`; removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= params.top_p  # keep the token crossing top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, state: SamplingState) -> int:
    if state.params.is_greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, state.params), -1)
    # An exponential race: argmax(p / E) with E ~ Exp(1) draws from p, with noise from the request's
    # own generator so a seeded request gives the same text whatever it is batched with.
    noise = torch.empty_like(probs).exponential_(generator=state.generator)
    return int(torch.argmax(probs / noise))


def token_logprob(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Logits `[n, vocab]` of n positions and the token that followed each -> that token's logprob and the
    `num_top` most likely tokens, per position."""
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs.gather(1, torch.tensor(next_ids, device=logits.device)[:, None])[:, 0].tolist()
    if not num_top:
        return [TokenLogprob(t, lp) for t, lp in zip(next_ids, chosen, strict=True)]
    values, ids = torch.topk(logprobs, num_top)
    return [TokenLogprob(t, lp, tuple(zip(top_ids, top_values)))
            for t, lp, top_ids, top_values in zip(next_ids, chosen, ids.tolist(), values.tolist(), strict=True)]


def _is_plain_greedy(state: SamplingState) -> bool:
    p = state.params
    return (p.is_greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits `[rows, vocab]` float32, one state per row -> a token per row and its logprobs if asked."""
    if all(_is_plain_greedy(s) for s in states):  # the common decode batch: one argmax, one sync
        return logits.argmax(-1).tolist(), [None] * len(states)
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for row, state in zip(logits, states):
        raw = torch.log_softmax(row, -1) if state.params.logprobs is not None else None
        token = sample_row(apply_penalties(row.clone(), state), state)
        tokens.append(token)
        logprobs.append(None if raw is None else token_logprob(raw, token, state.params.logprobs or 0))
    return tokens, logprobs
