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
    return filter_rows(logits[None], [params])[0]


def filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`filter_logits` on rows `[rows, vocab]`, each with its own params, in a few launches for all of them: each
    row divided by its temperature, then (in this order, each on what the one before left) its top-k (ties of the
    k-th kept), top-p (the token that crosses top_p kept) and min-p filters; removed tokens get -inf."""
    device = logits.device
    column = lambda values: torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # noqa: E731
    logits = logits / column([p.temperature for p in params])
    ks = [min(p.top_k, logits.shape[-1]) for p in params]
    if any(ks):
        kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks],
                                                                                 device=device)[:, None])
        has_k = torch.tensor([k > 0 for k in ks], device=device)[:, None]
        logits = logits.masked_fill(has_k & (logits < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        top_p = column([p.top_p for p in params])
        # NOTE: a float32 cumulative sum reaches 1 before a large vocabulary's tail: a top_p of 1 drops nothing
        drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < column([p.min_p for p in params]) * probs.amax(-1, keepdim=True),
                                    float("-inf"))
    return logits


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """A token per row of `probs` by an exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A row with a
    generator (a seeded request) draws its noise from it alone, so its text does not depend on its batch; the
    others draw theirs together."""
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty((len(shared), probs.shape[-1]), device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return torch.argmax(probs / noise, -1)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def on_device(states: Sequence[SamplingState]) -> bool:
    """Whether `sample_on_device` samples these rows: no penalties (they read the tokens sampled so far) and no
    logprobs (read on the host)."""
    return all(s.params.logprobs is None and not _has_penalties(s.params) for s in states)


def sample_on_device(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Rows that `on_device` takes -> their tokens `[rows]` int64, left on the logits' device (launched, not waited
    for): greedy rows by argmax, the others filtered and drawn together (`filter_rows`, `_draw`)."""
    chosen = logits.argmax(-1)
    drawn = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if drawn:
        probs = torch.softmax(filter_rows(logits[drawn], [states[i].params for i in drawn]), -1)
        chosen[drawn] = _draw(probs, [states[i].generator for i in drawn])
    return chosen


def sample(logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits `[rows, vocab]` float32, one state per row -> a token per row and its logprobs if asked. The rows are
    filtered and drawn together (`filter_rows`, `_draw`): one copy to the host a step, whatever the mix of greedy,
    sampled and seeded rows; only penalties are applied row by row."""
    if on_device(states):
        return sample_on_device(logits, states).tolist(), [None] * len(states)
    asked = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw = torch.log_softmax(logits[asked], -1) if asked else None
    penalized = [i for i, s in enumerate(states) if _has_penalties(s.params)]
    if penalized:
        logits = logits.clone()
        for i in penalized:
            apply_penalties(logits[i], states[i])
    tokens: list[int] = sample_on_device(logits, states).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(states)
    if raw is not None:
        num_top = max(states[i].params.logprobs or 0 for i in asked)
        picked = raw.gather(1, torch.tensor([tokens[i] for i in asked], device=raw.device)[:, None])[:, 0].tolist()
        top_values, top_ids = (t.tolist() for t in torch.topk(raw, num_top, dim=-1)) if num_top else ([], [])
        for j, i in enumerate(asked):
            n = states[i].params.logprobs or 0
            top = tuple(zip(top_ids[j][:n], top_values[j][:n])) if n else ()
            logprobs[i] = TokenLogprob(tokens[i], picked[j], top)
    return tokens, logprobs


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
