"""The reference text of a greedy continuation, from the synchronous engine and the tokenizer's decode."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams


def greedy_ids(path: Path, prompt: str, max_tokens: int) -> tuple[LLMEngine, list[int], list[int]]:
    """The engine, the prompt's ids and the ids of a greedy run of `max_tokens` tokens."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=128)))
    ids = engine.tokenizer.encode(prompt)
    engine.add_request(Request("a", tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True)))
    output: list[int] = []
    while engine.has_unfinished():
        output += [t for out in engine.step() for t in out.new_token_ids]
    return engine, ids, output


def greedy_continuation(path: Path, prompt: str, max_tokens: int) -> str:
    """decode(prompt + output)[len(decode(prompt)):] of a greedy run whose first token starts with a space
    (the case a SentencePiece continuation must keep)."""
    engine, ids, output = greedy_ids(path, prompt, max_tokens)
    assert engine.tokenizer.token_text(output[0]).startswith(" ")
    return engine.tokenizer.decode([*ids, *output])[len(engine.tokenizer.decode(ids)):]
