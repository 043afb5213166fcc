"""Runs of the synchronous engine the tests compare with: greedy continuations and teacher-forced log-probabilities."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.model import SeqSpan
from engine.types import Request, SamplingParams


def greedy(engine: LLMEngine, ids: list[int], max_tokens: int) -> list[int]:
    """The ids of a greedy run of `max_tokens` tokens after `ids` (the engine otherwise idle)."""
    engine.add_request(Request("a", tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True)))
    output: list[int] = []
    while engine.has_unfinished():
        output += [t for out in engine.step() for t in out.new_token_ids]
    return output


def greedy_ids(path: Path, prompt: str, max_tokens: int) -> tuple[LLMEngine, list[int], list[int]]:
    """The engine, the prompt's ids and the ids of a greedy run of `max_tokens` tokens."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=128)))
    ids = engine.tokenizer.encode(prompt)
    return engine, ids, greedy(engine, ids, max_tokens)


def greedy_continuation(path: Path, prompt: str, max_tokens: int) -> str:
    """decode(prompt + output)[len(decode(prompt)):] of a greedy run whose first token starts with a space
    (the case a SentencePiece continuation must keep)."""
    engine, ids, output = greedy_ids(path, prompt, max_tokens)
    assert engine.tokenizer.token_text(output[0]).startswith(" ")
    return engine.tokenizer.decode([*ids, *output])[len(engine.tokenizer.decode(ids)):]


def teacher_forced(engine: LLMEngine, ids: list[int], prefill: int) -> torch.Tensor:
    """Log-softmax after positions prefill - 1 .. len(ids) - 1: a prefill chunk of `prefill` tokens, then one
    decode step per token, as generation runs (KV slot 0, the engine otherwise idle); `[rows, vocab]`."""
    rows: list[torch.Tensor] = []

    def run(span: SeqSpan, tokens: list[int]) -> None:
        # NOTE: a copy: a captured step's logits are its graph's output buffer, which the next step overwrites
        engine.forward([span], [tokens], ["teacher"] * len(tokens), lambda logits: rows.append(logits[0].clone()))

    run(SeqSpan(0, 0, prefill), ids[:prefill])
    for pos in range(prefill, len(ids)):
        run(SeqSpan(0, pos, 1), [ids[pos]])
    return torch.log_softmax(torch.stack(rows), dim=-1)
