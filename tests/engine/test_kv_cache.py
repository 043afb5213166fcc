"""The KV cache in bf16, q8_0 and q4_0 (per K and V): its size as the engine and `plan` count it, its
refusals, and the engine generating on the CPU with each type against the unquantized cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.arch import get_arch
from engine.config import EngineConfig, ModelConfig
from engine.gguf.reader import GGUFFile
from engine.kv_cache import KVCache, check_kv_fits, kv_cache_bytes
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
    # 2 layers of 2 kv heads of 128, 3 slots, 64 positions
    kv = KVCache([(2, 128)] * 2, 3, 64, dtype, torch.device("cpu"), k_type=types[0], v_type=types[1])
    row = {"bf16": 128 * dtype.itemsize, "q8_0": 4 * 34, "q4_0": 4 * 18}  # bytes of one head's row
    assert kv.num_bytes == 2 * 3 * 64 * 2 * sum(row[t] for t in types)
    assert kv.qtypes == tuple({"bf16": None, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}[t] for t in types)


@pytest.mark.parametrize("types", [("bf16", "bf16"), ("q8_0", "q4_0")])
def test_per_layer_shapes_take_the_types(types: tuple[str, str]) -> None:
    """Layers of different shapes (a tensor each; none cached by a layer of 0 heads) in each type."""
    shapes = [(2, 64), (1, 128), (2, 64), (0, 128)]
    kv = KVCache(shapes, 2, 16, torch.bfloat16, torch.device("cpu"), k_type=types[0], v_type=types[1])
    # a row: head_dim bf16 values, or its blocks' bytes
    row = {"bf16": lambda d: d, "q8_0": lambda d: d // 32 * 34, "q4_0": lambda d: d // 32 * 18}
    assert [tuple(k.shape) for k in kv.k] == [(2, heads, 16, row[types[0]](dim)) for heads, dim in shapes]
    assert [tuple(v.shape) for v in kv.v] == [(2, heads, 16, row[types[1]](dim)) for heads, dim in shapes]
    row["bf16"] = lambda d: 2 * d
    assert kv.num_bytes == sum(2 * heads * 16 * (row[types[0]](dim) + row[types[1]](dim)) for heads, dim in shapes)


def test_quantized_types_refuse_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="q8_0 KV cache needs head_dim a multiple of 32, got 80"):
        KVCache([(2, 80)], 2, 16, torch.float32, torch.device("cpu"), k_type="bf16", v_type="q8_0")
    assert KVCache([(2, 80)], 2, 16, torch.float32, torch.device("cpu")).num_bytes == 2 * 2 * 16 * 2 * 80 * 4


def test_the_mla_latent_cache_refuses_quantized_types(preset_gguf: Callable[[str], Path]) -> None:
    """DeepSeek's latent cache holds keys and values in one tensor, kept in bf16: a quantized K or V type is
    refused before the weights load, by the cache itself, and by `kv_cache_bytes` (`moecache plan`)."""
    path = preset_gguf("deepseek2-tiny")
    gguf = GGUFFile(path)
    hp = get_arch(gguf.architecture).hparams(gguf.metadata, vocab_size=0)
    assert hp.mla is not None
    for k_type, v_type in (("q8_0", "bf16"), ("bf16", "q4_0"), ("q8_0", "q8_0")):
        message = (f"deepseek2 caches an MLA latent .*got K {k_type}, V {v_type} "
                   "\\(--kv-cache-dtype, -ctk/--cache-type-k")
        with pytest.raises(ValueError, match=message):
            make_engine(path, k_type, v_type)
        with pytest.raises(ValueError, match=message):
            KVCache.for_model(hp, 2, 16, torch.float32, torch.device("cpu"), k_type, v_type)
        with pytest.raises(ValueError, match=message):
            kv_cache_bytes(hp, 2, 16, torch.bfloat16, k_type, v_type)
    with pytest.raises(ValueError, match="a latent KV cache .* is kept in bf16"):
        KVCache([(1, 96)] * 2, 2, 16, torch.float32, torch.device("cpu"), 64, "q8_0", "bf16")
    # bf16 stays: one latent tensor, the values its first kv_lora_rank columns
    kv = KVCache.for_model(hp, 2, 16, torch.float32, torch.device("cpu"))
    assert kv.is_latent and kv.qtypes == (None, None) and kv.v[0].data_ptr() == kv.k[0].data_ptr()
    assert kv.num_bytes == kv_cache_bytes(hp, 2, 16, torch.float32) == hp.num_layers * 2 * 16 * hp.mla.latent_dim * 4
    assert greedy(make_engine(path, "bf16", "bf16"), [1, 2, 3], 4)


def test_a_cache_larger_than_the_free_memory_is_refused_with_its_size(tiny_gguf: Path) -> None:
    gguf = GGUFFile(tiny_gguf)
    hp = get_arch(gguf.architecture).hparams(gguf.metadata, vocab_size=0)
    size = kv_cache_bytes(hp, 33, 32768, torch.bfloat16)  # 32 sequences and the scratch slot
    check_kv_fits(hp, 32, 32768, torch.bfloat16, ("bf16", "bf16"), size)  # exactly fits
    check_kv_fits(hp, 32, 32768, torch.bfloat16, ("bf16", "bf16"), None)  # the host: not checked
    with pytest.raises(ValueError, match=r"the KV cache needs .* GiB \(32 sequences of 32768 positions.*"
                       r"--max-num-seqs or -c/--ctx-size.*--kv-cache-dtype"):
        check_kv_fits(hp, 32, 32768, torch.bfloat16, ("bf16", "bf16"), size - 1)
    # q8_0 rows take about half: the same memory then holds it
    check_kv_fits(hp, 32, 32768, torch.bfloat16, ("q8_0", "q8_0"), size // 2 + size // 16)


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


# mean KL(bf16 || quantized) on random-weight presets whose attention runs in torch over the dequantized
# window: gpt-oss (sinks, sliding windows) measured q8_0 1.0e-4, q4_0 1.5e-3, q8_0 K with q4_0 V 1.5e-3;
# gemma4 (windows, per-layer head sizes, shared-KV layers; normed keys at scale 1) 2.2e-3, 4.3e-2, 2.5e-2
PRESET_KL_BOUNDS = {"gpt-oss-tiny": {("q8_0", "q8_0"): 5e-4, ("q4_0", "q4_0"): 6e-3, ("q8_0", "q4_0"): 6e-3},
                    "gemma4-tiny": {("q8_0", "q8_0"): 1e-2, ("q4_0", "q4_0"): 0.15, ("q8_0", "q4_0"): 0.1}}


@pytest.mark.parametrize("preset", list(PRESET_KL_BOUNDS))
def test_quantized_types_beside_windows_sinks_and_per_layer_shapes(preset: str,
                                                                   preset_gguf: Callable[[str], Path]) -> None:
    path = preset_gguf(preset)
    base = make_engine(path, "bf16", "bf16")
    ids = base.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # past the presets' 16-position window
    ref = teacher_forced(base, ids, 6)
    kls = {}
    for types, bound in PRESET_KL_BOUNDS[preset].items():
        engine = make_engine(path, *types)
        assert engine.kv.num_bytes < base.kv.num_bytes
        lp = teacher_forced(engine, ids, 6)
        kls[types] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        assert 0 < kls[types] < bound, types
    assert kls[("q8_0", "q8_0")] < kls[("q4_0", "q4_0")]
