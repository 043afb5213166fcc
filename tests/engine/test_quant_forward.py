"""Every quant type in one mixed-type model, through the engine's whole forward (prefill and decode, its
expert paths: the native CPU kernel where all three expert tensors have one, torch elsewhere, resident
or behind the expert cache), against the independent float reference: gguf-py's numpy dequantization
of the same file run by HF transformers.

Routing makes a MoE forward discontinuous: an error of 1% in one layer's experts can flip a later
router's top-k choice and move a token's log-probability by tenths of a nat. So the bound here is
what float32 rounding gives, not what a lossy kernel usually gets away with."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from engine.arch import HParams, get_arch
from engine.arch.base import GLOBAL_TENSORS, layer_tensor
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from ops.quants import QType, format_of, random_blocks, supported_types
from ops.qweight import Q8Weight
from tests.engine_runs import teacher_forced
from tests.gguf_reference import reference_logprobs, reference_model
from tools.embedded_vocab import build_embedded_vocab
from tools.gguf_writer import TensorSpec, write_gguf

# gate, up, down of each MoE layer: three layers the native kernel runs (K-quants with a Q8_0 down as
# llama.cpp's Q4_K_M gives 128-column Mixtral experts, mixed int8 and float activations), three the
# torch path runs (Q5_0 down as the other Q4_K_M layers of those experts)
EXPERT_TYPES = [
    (QType.Q4_K, QType.Q4_K, QType.Q8_0),
    (QType.Q5_K, QType.Q6_K, QType.Q4_K),
    (QType.Q8_0, QType.F16, QType.BF16),
    (QType.Q4_K, QType.Q4_K, QType.Q5_0),
    (QType.Q2_K, QType.Q3_K, QType.IQ4_XS),
    (QType.Q4_0, QType.Q4_1, QType.Q5_1),
]
DENSE_TYPES = [t for t in supported_types() if t != QType.F32] + [QType.F32]  # cycled over dense matrices
SCALE = 0.05  # weight RMS: peaky enough that the argmax is far from ties
PROMPT_LEN, PREFILL = 40, 24
# Measured with float-accurate expert kernels: <= 2e-4 nats over these positions and the whole vocabulary.
# int8 activations (x and h rounded to 1/254 of their block maximum) give 0.05-0.5 here.
MAX_LOGPROB_ERROR = 2e-3
CACHES = {"resident": CacheConfig(), "cached": CacheConfig(cpu_moe=True, budget_mib=1, policy="lru")}


def hparams(arch: str) -> HParams:
    return HParams(arch=arch, num_layers=len(EXPERT_TYPES), hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
                   vocab_size=len(build_embedded_vocab()["tokenizer.ggml.tokens"]), context_length=512,
                   rms_eps=1e-5, rope_theta=1e4, num_experts=4, top_k=2, expert_ff=256,
                   norm_topk=get_arch(arch).norm_topk)


def random_tensor(name: str, shape: tuple[int, ...], qtype: QType, seed: int) -> TensorSpec:
    def make() -> torch.Tensor:
        num_blocks = int(torch.tensor(shape).prod()) // format_of(qtype).block_size
        blocks = random_blocks(qtype, num_blocks, torch.Generator().manual_seed(seed), SCALE)
        return blocks.reshape(*shape[:-1], -1)

    return TensorSpec(name, shape, qtype, make)


def norm_tensor(name: str, size: int, seed: int) -> TensorSpec:
    values = 1 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return TensorSpec(name, (size,), QType.F32, lambda: values.view(torch.uint8))


def model_tensors(hp: HParams) -> Iterator[TensorSpec]:
    dense = iter(DENSE_TYPES * 8)
    q_dim, kv_dim, e, ff = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim, hp.num_experts, hp.expert_ff
    yield random_tensor(GLOBAL_TENSORS["embed"], (hp.vocab_size, hp.hidden), next(dense), 1)
    for i, (gate, up, down) in enumerate(EXPERT_TYPES):
        t, seed = partial(layer_tensor, i), 100 * (i + 1)
        yield norm_tensor(t("attn_norm"), hp.hidden, seed)
        for j, (role, rows) in enumerate((("q", q_dim), ("k", kv_dim), ("v", kv_dim))):
            yield random_tensor(t(role), (rows, hp.hidden), next(dense), seed + 1 + j)
        yield random_tensor(t("o"), (hp.hidden, q_dim), next(dense), seed + 4)
        if get_arch(hp.arch).qk_norm == "head":
            yield norm_tensor(t("q_norm"), hp.head_dim, seed + 5)
            yield norm_tensor(t("k_norm"), hp.head_dim, seed + 6)
        yield norm_tensor(t("ffn_norm"), hp.hidden, seed + 7)
        yield random_tensor(t("router"), (e, hp.hidden), QType.F32, seed + 8)
        yield random_tensor(t("gate_exps"), (e, ff, hp.hidden), gate, seed + 9)
        yield random_tensor(t("up_exps"), (e, ff, hp.hidden), up, seed + 10)
        yield random_tensor(t("down_exps"), (e, hp.hidden, ff), down, seed + 11)
    yield norm_tensor(GLOBAL_TENSORS["norm"], hp.hidden, 2)
    # Q8_0, as synth files hold it: the matrix a loader may keep as Q8_0 (`dense_weights`)
    yield random_tensor(GLOBAL_TENSORS["output"], (hp.vocab_size, hp.hidden), QType.Q8_0, 3)


@pytest.fixture(scope="module", params=["qwen3moe", "llama"])
def mixed_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hp = hparams(request.param)
    path = tmp_path_factory.mktemp("mixed") / f"mixed-{request.param}.gguf"
    write_gguf(path, hp.arch, {**get_arch(hp.arch).metadata(hp), **build_embedded_vocab()}, model_tensors(hp))
    return path


def test_the_model_holds_every_supported_type(mixed_gguf: Path) -> None:
    from gguf import GGUFReader

    held = {t.tensor_type for t in GGUFReader(mixed_gguf).tensors}
    assert held == set(supported_types())


@pytest.mark.parametrize("dense", ["dtype", "q8_0"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_forward_matches_the_float_reference(mixed_gguf: Path, cache: str, dense: str) -> None:
    """dense q8_0: the Q8_0 matrices stay Q8_0 (`ops.qweight`), multiplied as such (`ops.fused.linear`)."""
    ids = torch.randint(0, 4096, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = reference_logprobs(reference_model(mixed_gguf), ids)[PREFILL - 1:]
    engine = LLMEngine(EngineConfig(ModelConfig(str(mixed_gguf), device="cpu", max_context=128,
                                                dense_weights=dense), CACHES[cache]))
    kept = [layer.attn.o for layer in engine.weights.layers] + [engine.weights.output]
    assert any(isinstance(m, Q8Weight) for m in kept) == (dense == "q8_0")
    got = teacher_forced(engine, ids, PREFILL)
    engine.close()
    assert float(expected.max(-1).values.mean()) > -6.0  # peaky: far from a uniform 4096-way choice
    error = float((got - expected).abs().max())
    assert error < MAX_LOGPROB_ERROR, f"max |log-probability error| {error:.3g} nats"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
