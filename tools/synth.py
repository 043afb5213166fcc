"""Random-weight GGUF models of any supported architecture at named size presets (tests, benchmarks,
the embedded default model). Tensors are random valid quantized blocks, written one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.arch import HParams, get_arch
from engine.arch.base import GLOBAL_TENSORS, MLA, Routing, YaRN, layer_tensor, sliding_pattern, yarn_mscale
from engine.gguf.vocab import TokenType
from ops.quants import QType, format_of, random_blocks
from tools.gguf_writer import TensorSpec, write_gguf


@dataclass(frozen=True)
class Preset:
    name: str
    hparams: HParams
    dense_type: QType = QType.Q8_0  # attention, embeddings, output, dense and shared FFNs
    expert_type: QType = QType.Q4_K  # routed experts
    dense_layers: tuple[int, ...] = ()  # layers with a dense FFN instead of experts (and hparams.num_dense_layers)
    description: str = ""
    vocab: str = "embedded"  # the tokenizer recipe (`tools.embedded_vocab.RECIPES`): the family's kind

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers or layer < self.hparams.num_dense_layers


def _hp(arch: str, **kw: Any) -> HParams:
    defaults = dict(arch=arch, context_length=4096, rms_eps=1e-6, rope_theta=1e6, vocab_size=151936,
                    norm_topk=get_arch(arch).norm_topk)
    return HParams(**{**defaults, **kw})


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("tiny", _hp("qwen3moe", num_layers=2, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       vocab_size=0, num_experts=8, top_k=2, expert_ff=256, dense_ff=512),
           description="two layers, for tests"),
    Preset("embedded", _hp("qwen3moe", num_layers=8, hidden=256, num_heads=8, num_kv_heads=2, head_dim=32,
                           vocab_size=0, num_experts=32, top_k=4, expert_ff=256, dense_ff=512),
           description="the default model: small, random weights"),
    Preset("qwen3moe-30b-a3b", _hp("qwen3moe", num_layers=48, hidden=2048, num_heads=32, num_kv_heads=4,
                                   head_dim=128, num_experts=128, top_k=8, expert_ff=768, context_length=40960),
           description="Qwen3-30B-A3B shapes, Q4_K experts (about 17 GB)"),
    Preset("qwen3moe-235b-a22b", _hp("qwen3moe", num_layers=94, hidden=4096, num_heads=64, num_kv_heads=4,
                                     head_dim=128, num_experts=128, top_k=8, expert_ff=1536,
                                     context_length=40960), description="Qwen3-235B-A22B shapes"),
    Preset("qwen2moe-a2.7b", _hp("qwen2moe", num_layers=24, hidden=2048, num_heads=16, num_kv_heads=16,
                                 head_dim=128, num_experts=60, top_k=4, expert_ff=1408, shared_ff=5632,
                                 rms_eps=1e-6), description="Qwen1.5-MoE-A2.7B shapes"),
    Preset("mixtral-8x7b", _hp("llama", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                               vocab_size=32000, num_experts=8, top_k=2, expert_ff=14336, rms_eps=1e-5),
           description="Mixtral-8x7B shapes"),
    Preset("olmoe-1b-7b", _hp("olmoe", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=16, head_dim=128,
                              vocab_size=50304, num_experts=64, top_k=8, expert_ff=1024, rms_eps=1e-5,
                              rope_theta=1e4), description="OLMoE-1B-7B shapes"),
    Preset("deepseek-v2-lite", _hp("deepseek2", num_layers=27, hidden=2048, num_heads=16, num_kv_heads=1,
                                   head_dim=192, vocab_size=102400, context_length=163840, rope_theta=1e4,
                                   num_experts=64, top_k=6, expert_ff=1408, dense_ff=10944, shared_ff=2816,
                                   num_dense_layers=1, mla=MLA(0, 512, 128, 64, 128, mscale_all_dim=0.707),
                                   yarn=YaRN(40.0, 4096)),
           description="DeepSeek-V2-Lite shapes (MLA, 2 shared experts, a leading dense layer)", vocab="deepseek-v3"),
    Preset("deepseek2-tiny", _hp("deepseek2", num_layers=4, hidden=256, num_heads=4, num_kv_heads=1, head_dim=64,
                                 vocab_size=0, num_experts=16, top_k=4, expert_ff=256, dense_ff=512, shared_ff=256,
                                 num_dense_layers=1, norm_topk=True, mla=MLA(128, 128, 32, 32, 64, 1.0),
                                 yarn=YaRN(4.0, 1024), routing=Routing("sigmoid", 4, 2, "top2", 2.5)),
           description="deepseek2 for tests: q LoRA, DeepSeek-V3 routing (sigmoid, bias, groups), YaRN",
           vocab="deepseek-v3"),
    Preset("gpt-oss-20b", _hp("gpt-oss", num_layers=24, hidden=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                              vocab_size=201088, context_length=131072, rms_eps=1e-5, rope_theta=150000.0,
                              num_experts=32, top_k=4, expert_ff=2880, sliding_window=128,
                              sliding_layers=sliding_pattern(24, 2),
                              yarn=YaRN(32.0, 4096, attn_factor=yarn_mscale(32.0), truncate=False)),
           expert_type=QType.MXFP4, description="gpt-oss-20b shapes, MXFP4 experts (about 13 GB)", vocab="gpt-oss"),
    Preset("gpt-oss-tiny", _hp("gpt-oss", num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
                               vocab_size=0, rms_eps=1e-5, rope_theta=150000.0, num_experts=16, top_k=4,
                               expert_ff=256, sliding_window=16, sliding_layers=sliding_pattern(4, 2),
                               yarn=YaRN(4.0, 256, attn_factor=yarn_mscale(4.0), truncate=False)),
           expert_type=QType.MXFP4, description="gpt-oss for tests: sinks, a 16-position window, MXFP4 experts",
           vocab="gpt-oss"),
    # Q4_0 experts: K-quants cannot hold the 704-column down rows; 4.5 bits everywhere make 3.35 MB an expert
    Preset("gemma4-26b-a4b", _hp("gemma4", num_layers=30, hidden=2816, num_heads=16, num_kv_heads=2, head_dim=512,
                                 vocab_size=262144, context_length=262144, num_experts=128, top_k=8, expert_ff=704,
                                 dense_ff=2112, norm_topk=True, sliding_window=1024, swa_head_dim=256, swa_kv_heads=8,
                                 swa_rope_theta=1e4, sliding_layers=sliding_pattern(30, 6), logit_softcap=30.0),
           expert_type=QType.Q4_0, vocab="gemma4",
           description="Gemma 4 26B-A4B shapes (a dense GELU MLP beside 128 experts, 5 sliding layers to 1 full)"),
    Preset("gemma4-tiny", _hp("gemma4", num_layers=4, hidden=256, num_heads=4, num_kv_heads=1, head_dim=128,
                              vocab_size=0, num_experts=16, top_k=4, expert_ff=256, dense_ff=512, norm_topk=True,
                              sliding_window=16, swa_head_dim=64, swa_kv_heads=2, swa_rope_theta=1e4,
                              sliding_layers=sliding_pattern(4, 2), logit_softcap=30.0),
           vocab="gemma4", description="gemma4 for tests: a 16-position window, wide full-attention heads"),
]}


def fitting_type(qtype: QType, num_cols: int) -> QType:
    """`qtype` if a row of `num_cols` is whole blocks of it, else Q8_0 (as llama.cpp's quantizer falls
    back for rows that K-quants cannot hold), else F16."""
    for candidate in (qtype, QType.Q8_0, QType.F16):
        if num_cols % format_of(candidate).block_size == 0:
            return candidate
    return QType.F32


@dataclass
class _Random:
    seed: int
    scale: float = 0.02
    device: str = "cpu"  # where random blocks are drawn (a GPU draws a 17 GB model in seconds)
    counter: list[int] = field(default_factory=lambda: [0])

    def tensor(self, name: str, shape: tuple[int, ...], qtype: QType, ones: bool = False) -> TensorSpec:
        qtype = QType.F32 if ones else fitting_type(qtype, shape[-1])
        self.counter[0] += 1
        seed = self.seed * 1_000_003 + self.counter[0]
        return TensorSpec(name, shape, qtype, lambda: self._make(shape, qtype, seed, ones))

    def _make(self, shape: tuple[int, ...], qtype: QType, seed: int, ones: bool) -> torch.Tensor:
        if ones:
            return torch.ones(shape, dtype=torch.float32).view(torch.uint8)
        fmt = format_of(qtype)
        num_blocks = int(torch.tensor(shape).prod()) // fmt.block_size
        gen = torch.Generator(self.device).manual_seed(seed)
        return random_blocks(qtype, num_blocks, gen, self.scale).reshape(*shape[:-1], -1).cpu()


def model_tensors(preset: Preset, seed: int, device: str = "cpu") -> Iterator[TensorSpec]:
    hp, rnd = preset.hparams, _Random(seed, device=device)
    yield rnd.tensor(GLOBAL_TENSORS["embed"], (hp.vocab_size, hp.hidden), preset.dense_type)
    if hp.arch == "gemma4":
        yield from _gemma4_tensors(preset, rnd)
        return
    for i in range(hp.num_layers):
        yield from _attention_tensors(preset, rnd, i)
        yield from _ffn_tensors(preset, rnd, i)
    yield rnd.tensor(GLOBAL_TENSORS["norm"], (hp.hidden,), preset.dense_type, ones=True)
    yield rnd.tensor(GLOBAL_TENSORS["output"], (hp.vocab_size, hp.hidden), preset.dense_type)


def _gemma4_tensors(preset: Preset, rnd: _Random) -> Iterator[TensorSpec]:
    """Gemma 4 as its GGUFs hold it: proportional rope (a quarter of the full layers' dimensions rotate), no v
    in full layers (keys as values), merged gate/up experts, the output tied to the embedding."""
    hp, dense = preset.hparams, preset.dense_type
    rotated = hp.head_dim // 8
    factors = torch.tensor([1.0] * rotated + [1e30] * (hp.head_dim // 2 - rotated))
    yield TensorSpec(GLOBAL_TENSORS["rope_freqs"], (hp.head_dim // 2,), QType.F32, lambda: factors.view(torch.uint8))
    for i in range(hp.num_layers):
        t, hd, e = partial(layer_tensor, i), hp.head_dim_of(i), hp.num_experts
        q_dim, kv_dim = hp.num_heads * hd, hp.kv_heads_of(i) * hd
        for role in ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "pre_ffn_norm_2",
                     "post_ffn_norm_1", "post_ffn_norm_2", "router_scale"):
            yield rnd.tensor(t(role), (hp.hidden,), dense, ones=True)
        roles = [("q", (q_dim, hp.hidden)), ("k", (kv_dim, hp.hidden)), ("v", (kv_dim, hp.hidden)),
                 ("o", (hp.hidden, q_dim)), ("gate", (hp.dense_ff, hp.hidden)), ("up", (hp.dense_ff, hp.hidden)),
                 ("down", (hp.hidden, hp.dense_ff))]
        yield from (rnd.tensor(t(role), shape, dense) for role, shape in roles if role != "v" or hp.is_sliding(i))
        yield from (rnd.tensor(t(role), (hd,), dense, ones=True) for role in ("q_norm", "k_norm"))
        yield rnd.tensor(t("router"), (e, hp.hidden), QType.F32)
        yield rnd.tensor(t("gate_up_exps"), (e, 2 * hp.expert_ff, hp.hidden), preset.expert_type)
        yield rnd.tensor(t("down_exps"), (e, hp.hidden, hp.expert_ff), preset.expert_type)
        yield rnd.tensor(t("down_exps_scale"), (e,), QType.F32, ones=True)
        yield rnd.tensor(t("out_scale"), (1,), QType.F32, ones=True)
    yield rnd.tensor(GLOBAL_TENSORS["norm"], (hp.hidden,), dense, ones=True)


def _attention_tensors(preset: Preset, rnd: _Random, i: int) -> Iterator[TensorSpec]:
    hp, arch, dense, t = preset.hparams, get_arch(preset.hparams.arch), preset.dense_type, partial(layer_tensor, i)
    q_dim, kv_dim = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    yield rnd.tensor(t("attn_norm"), (hp.hidden,), dense, ones=True)
    if hp.mla is not None:
        yield from _mla_tensors(hp, hp.mla, rnd, dense, i)
        yield rnd.tensor(t("ffn_norm"), (hp.hidden,), dense, ones=True)
        return
    yield rnd.tensor(t("q"), (q_dim, hp.hidden), dense)
    yield rnd.tensor(t("k"), (kv_dim, hp.hidden), dense)
    yield rnd.tensor(t("v"), (kv_dim, hp.hidden), dense)
    yield rnd.tensor(t("o"), (hp.hidden, q_dim), dense)
    if arch.attn_bias:
        for role, dim in (("q_bias", q_dim), ("k_bias", kv_dim), ("v_bias", kv_dim)):
            yield rnd.tensor(t(role), (dim,), QType.F32)
    if arch.qk_norm != "none":
        full = arch.qk_norm == "full"
        yield rnd.tensor(t("q_norm"), (q_dim if full else hp.head_dim,), dense, ones=True)
        yield rnd.tensor(t("k_norm"), (kv_dim if full else hp.head_dim,), dense, ones=True)
    yield rnd.tensor(t(arch.ffn_norm), (hp.hidden,), dense, ones=True)


def _mla_tensors(hp: HParams, m: MLA, rnd: _Random, dense: QType, i: int) -> Iterator[TensorSpec]:
    t, q_dim = partial(layer_tensor, i), hp.num_heads * (m.nope_dim + m.rope_dim)
    if m.q_lora_rank:
        yield rnd.tensor(t("q_a"), (m.q_lora_rank, hp.hidden), dense)
        yield rnd.tensor(t("q_a_norm"), (m.q_lora_rank,), dense, ones=True)
        yield rnd.tensor(t("q_b"), (q_dim, m.q_lora_rank), dense)
    else:
        yield rnd.tensor(t("q"), (q_dim, hp.hidden), dense)
    yield rnd.tensor(t("kv_a"), (m.latent_dim, hp.hidden), dense)
    yield rnd.tensor(t("kv_a_norm"), (m.kv_lora_rank,), dense, ones=True)
    yield rnd.tensor(t("k_b"), (hp.num_heads, m.kv_lora_rank, m.nope_dim), dense)
    yield rnd.tensor(t("v_b"), (hp.num_heads, m.v_dim, m.kv_lora_rank), dense)
    yield rnd.tensor(t("o"), (hp.hidden, hp.num_heads * m.v_dim), dense)


def _ffn_tensors(preset: Preset, rnd: _Random, i: int) -> Iterator[TensorSpec]:
    hp, dense, t = preset.hparams, preset.dense_type, partial(layer_tensor, i)
    if preset.is_dense(i):
        yield rnd.tensor(t("gate"), (hp.dense_ff, hp.hidden), dense)
        yield rnd.tensor(t("up"), (hp.dense_ff, hp.hidden), dense)
        yield rnd.tensor(t("down"), (hp.hidden, hp.dense_ff), dense)
        return
    e, ff = hp.num_experts, hp.expert_ff
    yield rnd.tensor(t("router"), (e, hp.hidden), QType.F32)
    if hp.routing.gating == "sigmoid":
        yield rnd.tensor(t("score_bias"), (e,), QType.F32)
    yield rnd.tensor(t("gate_exps"), (e, ff, hp.hidden), preset.expert_type)
    yield rnd.tensor(t("up_exps"), (e, ff, hp.hidden), preset.expert_type)
    yield rnd.tensor(t("down_exps"), (e, hp.hidden, ff), preset.expert_type)
    if hp.shared_ff:
        yield rnd.tensor(t("gate_shexp"), (hp.shared_ff, hp.hidden), dense)
        yield rnd.tensor(t("up_shexp"), (hp.shared_ff, hp.hidden), dense)
        yield rnd.tensor(t("down_shexp"), (hp.hidden, hp.shared_ff), dense)
    if get_arch(hp.arch).shared_expert:  # the shared expert's sigmoid gate
        yield rnd.tensor(t("shared_gate_inp"), (hp.hidden,), QType.F32)
    for role, shape in get_arch(hp.arch).extra_tensors(hp):
        yield rnd.tensor(t(role), shape, QType.F32)


def padded_vocab(vocab: dict[str, Any], size: int) -> dict[str, Any]:
    """Tokenizer metadata padded to the model's vocabulary size with normal tokens of visible text.

    A random-weight model samples the padding as often as any token; unused tokens would decode to nothing
    and leave its streams without text. Their text splits into no two tokens, so no merge reaches them and
    the encoding of any text is unchanged."""
    tokens = list(vocab["tokenizer.ggml.tokens"])
    if size < len(tokens):
        raise ValueError(f"vocabulary of {size} is smaller than the tokenizer's {len(tokens)} tokens")
    extra = size - len(tokens)
    padded = {**vocab, "tokenizer.ggml.tokens": tokens + [f"<|pad_{i}|>" for i in range(extra)],
              "tokenizer.ggml.token_type": list(vocab["tokenizer.ggml.token_type"]) + [int(TokenType.NORMAL)] * extra}
    if "tokenizer.ggml.scores" in vocab:  # SentencePiece vocabularies score every token
        padded["tokenizer.ggml.scores"] = list(vocab["tokenizer.ggml.scores"]) + [0.0] * extra
    return padded


def write_synth(path: str | Path, preset: Preset, vocab: dict[str, Any], seed: int = 0,
                split_max_bytes: int = 0, progress: Callable[[int, int], None] | None = None,
                sparse: bool = False, device: str = "cpu") -> list[Path]:
    """Write a random-weight model. A preset with vocab_size 0 takes the tokenizer's size. `sparse`:
    shapes only, the data a hole of zeros (for `moecache plan`). The same seed gives the same bytes on
    the same kind of device."""
    size = preset.hparams.vocab_size or len(vocab["tokenizer.ggml.tokens"])
    preset = replace(preset, hparams=replace(preset.hparams, vocab_size=size))
    arch = get_arch(preset.hparams.arch)
    metadata = {**arch.metadata(preset.hparams), "general.name": f"moecache synth {preset.name}",
                **padded_vocab(vocab, size)}
    return write_gguf(path, arch.name, metadata, model_tensors(preset, seed, device), split_max_bytes=split_max_bytes,
                      progress=progress, sparse=sparse)


def with_overrides(preset: Preset, **overrides: Any) -> Preset:
    """A preset with some hyperparameters changed (`num_layers=4`, `num_experts=16`, ...)."""
    fields = {k: v for k, v in overrides.items() if v is not None}
    return replace(preset, hparams=replace(preset.hparams, **fields)) if fields else preset
