"""The KV cache in bf16, q8_0 and q4_0 (per K and V): its size as the engine and `plan` count it, its
refusals, and the engine generating on the CPU with each type against the unquantized cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCache, kv_cache_bytes
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from ops.quants import QType
from tests.engine_runs import teacher_forced

PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away into the forest where"
# mean KL(bf16 || quantized) of the next-token distributions over a teacher-forced prompt on the tiny model
# (measured: q8_0 1.2e-4, q4_0 1.2e-3, q8_0 K with q4_0 V 9.5e-4)
MEAN_KL_BOUNDS = {("q8_0", "q8_0"): 5e-4, ("q4_0", "q4_0"): 5e-3, ("q8_0", "q4_0"): 5e-3}


@pytest.mark.parametrize("types", [("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_size_counts_the_quantized_rows(dtype: torch.dtype, types: tuple[str, str]) -> None:
    dims = (2, 3, 64, 2, 128)  # layers, slots, positions, kv heads, head_dim
    kv = KVCache(*dims, dtype, torch.device("cpu"), *types)
    row = {"bf16": 128 * dtype.itemsize, "q8_0": 4 * 34, "q4_0": 4 * 18}  # bytes of one head's row
    assert kv.num_bytes == kv_cache_bytes(*dims, dtype, *types) == 2 * 3 * 64 * 2 * sum(row[t] for t in types)
    assert kv.qtypes == tuple({"bf16": None, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}[t] for t in types)


def test_quantized_types_refuse_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="q8_0 KV cache needs head_dim a multiple of 32, got 80"):
        KVCache(1, 2, 16, 2, 80, torch.float32, torch.device("cpu"), "bf16", "q8_0")
    assert KVCache(1, 2, 16, 2, 80, torch.float32, torch.device("cpu")).num_bytes == 2 * 2 * 16 * 2 * 80 * 4


def test_config_types_per_k_and_v() -> None:
    assert ModelConfig().kv_types == ("bf16", "bf16")
    assert ModelConfig(kv_cache_dtype="q8_0").kv_types == ("q8_0", "q8_0")
    assert ModelConfig(kv_cache_dtype="q8_0", cache_type_v="q4_0").kv_types == ("q8_0", "q4_0")
    assert ModelConfig(cache_type_k="q4_0").kv_types == ("q4_0", "bf16")
    with pytest.raises(ValueError, match="KV cache type must be one of bf16, q8_0, q4_0 \\(got 'q4_1'\\)"):
        ModelConfig(cache_type_k="q4_1")


def make_engine(path: Path, k_type: str, v_type: str) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=128, cache_type_k=k_type,
                                              cache_type_v=v_type)))


def greedy(engine: LLMEngine, ids: list[int], max_tokens: int) -> list[int]:
    engine.add_request(Request("a", tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True)))
    output: list[int] = []
    while engine.has_unfinished():
        output += [t for out in engine.step() for t in out.new_token_ids]
    return output


def test_q8_0_generates_the_greedy_text_of_bf16(tiny_gguf: Path) -> None:
    runs = []
    for types in (("bf16", "bf16"), ("q8_0", "q8_0")):
        engine = make_engine(tiny_gguf, *types)
        runs.append(greedy(engine, engine.tokenizer.encode(PROMPT), 16))
    assert len(runs[0]) == 16 and runs[1] == runs[0]


def test_quantized_log_probs_stay_near_bf16(tiny_gguf: Path) -> None:
    base = make_engine(tiny_gguf, "bf16", "bf16")
    ids = base.tokenizer.encode(PROMPT)
    ref = teacher_forced(base, ids, 6)  # a prefill chunk, then decode steps: both attention paths
    kls = {}
    for types, bound in MEAN_KL_BOUNDS.items():
        engine = make_engine(tiny_gguf, *types)
        assert engine.kv.num_bytes < base.kv.num_bytes
        lp = teacher_forced(engine, ids, 6)
        kls[types] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        assert 0 < kls[types] < bound, types
    assert kls[("q8_0", "q8_0")] < kls[("q4_0", "q4_0")]
