"""DeepSeek-V2 / V3 (`deepseek2` in GGUF, llama.cpp's name for both): multi-head latent attention whose KV
cache holds each token's compressed latent (arXiv:2405.04434), shared experts beside the routed ones, leading
dense layers, and routing by softmax (V2) or by sigmoid with a score-correction bias (V3, arXiv:2412.19437)
over groups of experts, the weights scaled by `routed_scaling_factor`.

Attention is computed in the latent space, as llama.cpp's `src/models/deepseek2.cpp` does: the key
decompression `k_b` is absorbed into q, so every head attends to the one cached latent (multi-query
attention with head size `kv_lora_rank + rope_dim`), and `v_b` decompresses the attention's output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from engine.arch.base import MLA, ArchSpec, HParams, TensorSource, layer_tensor, yarn_mscale
from ops.fused import linear, mla_out, mla_qk, rms_norm
from ops.qweight import Matrix

YARN_LOG_MUL_UNIT = 0.1  # llama.cpp's converter writes 0.1 x mscale_all_dim as the YaRN log multiplier


@dataclass(frozen=True)
class DeepSeek2Spec(ArchSpec):
    def read(self, md: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
        fields, k = super().read(md, vocab_size), self.key
        rope_dim = int(md[k("rope.dimension_count")])
        head_k = int(md.get(k("attention.key_length_mla"), fields["head_dim"]))
        mscale_all = float(md.get(k("rope.scaling.yarn_log_multiplier"), 0.0)) / YARN_LOG_MUL_UNIT
        mla = MLA(q_lora_rank=int(md.get(k("attention.q_lora_rank"), 0)),
                  kv_lora_rank=int(md[k("attention.kv_lora_rank")]), nope_dim=head_k - rope_dim, rope_dim=rope_dim,
                  v_dim=int(md.get(k("attention.value_length_mla"), md.get(k("attention.value_length"), head_k))),
                  mscale_all_dim=mscale_all)
        yarn = fields["yarn"]
        if yarn is not None and mscale_all:  # llama.cpp: mscale == mscale_all_dim, so cos/sin keep magnitude 1
            yarn = replace(yarn, attn_factor=1.0)
        return {**fields, "head_dim": head_k, "mla": mla, "yarn": yarn,
                "shared_ff": fields["expert_ff"] * int(md.get(k("expert_shared_count"), 0)),
                "num_dense_layers": int(md.get(k("leading_dense_block_count"), 0))}

    def group_score(self, gating: str) -> Literal["max", "top2"]:
        # V2's group_limited_greedy scores a group by its best expert, V3 by its best two (llama.cpp uses
        # the best two for both)
        return "max" if gating == "softmax" else "top2"

    def metadata(self, hp: HParams) -> dict[str, Any]:
        m, k = hp.mla, self.key
        assert m is not None, "deepseek2 hyperparameters carry their MLA shapes"
        md = {**super().metadata(hp),
              k("attention.head_count_kv"): 1, k("attention.key_length"): m.latent_dim,
              k("attention.value_length"): m.kv_lora_rank, k("attention.key_length_mla"): m.nope_dim + m.rope_dim,
              k("attention.value_length_mla"): m.v_dim, k("attention.q_lora_rank"): m.q_lora_rank,
              k("attention.kv_lora_rank"): m.kv_lora_rank, k("rope.dimension_count"): m.rope_dim,
              k("expert_shared_count"): hp.shared_ff // hp.expert_ff if hp.expert_ff else 0,
              k("leading_dense_block_count"): hp.num_dense_layers, k("expert_weights_norm"): hp.norm_topk}
        if hp.yarn is not None and m.mscale_all_dim:
            md[k("rope.scaling.yarn_log_multiplier")] = YARN_LOG_MUL_UNIT * m.mscale_all_dim
        return md


ARCH = DeepSeek2Spec(name="deepseek2", rope_style="normal", qk_norm="none", norm_topk=False)


@dataclass(frozen=True)
class MLAttention:
    in_proj: Matrix  # [q_rows + kv_lora_rank + rope_dim, hidden]: q (or its LoRA down-projection) and the
    # latent with the rotary key, one GEMV
    q_rows: int
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    k_b: torch.Tensor  # [heads, kv_lora_rank, nope_dim]: absorbed into q
    v_b: torch.Tensor  # [heads, v_dim, kv_lora_rank]: decompresses the attention's latent output
    o: Matrix  # [hidden, heads * v_dim]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: Matrix | None = None  # [heads * (nope_dim + rope_dim), q_lora_rank]


def load_attention(src: TensorSource, i: int, hp: HParams) -> MLAttention:
    m, t = hp.mla, lambda role: layer_tensor(i, role)
    assert m is not None, "deepseek2 hyperparameters carry their MLA shapes"
    q_dim = hp.num_heads * (m.nope_dim + m.rope_dim)
    if m.q_lora_rank:
        q = (t("q_a"), (m.q_lora_rank, hp.hidden))
        q_a_norm, q_b = src.dense(t("q_a_norm"), (m.q_lora_rank,)), src.matrix((t("q_b"), (q_dim, m.q_lora_rank)))
    else:
        q, q_a_norm, q_b = (t("q"), (q_dim, hp.hidden)), None, None
    k_b, v_b = _kv_decompression(src, i, hp, m)
    return MLAttention(src.matrix(q, (t("kv_a"), (m.latent_dim, hp.hidden))), q[1][0],
                       src.dense(t("kv_a_norm"), (m.kv_lora_rank,)), k_b, v_b,
                       src.matrix((t("o"), (hp.hidden, hp.num_heads * m.v_dim))), q_a_norm, q_b)


def _kv_decompression(src: TensorSource, i: int, hp: HParams, m: MLA) -> tuple[torch.Tensor, torch.Tensor]:
    t = lambda role: layer_tensor(i, role)  # noqa: E731
    if src.has(t("k_b")):
        return (src.dense(t("k_b"), (hp.num_heads, m.kv_lora_rank, m.nope_dim)),
                src.dense(t("v_b"), (hp.num_heads, m.v_dim, m.kv_lora_rank)))
    # older files keep HF's kv_b_proj whole: split it as llama.cpp's converter does
    kv_b = src.dense(t("kv_b"), (hp.num_heads * (m.nope_dim + m.v_dim), m.kv_lora_rank))
    k_b, v_b = kv_b.view(hp.num_heads, m.nope_dim + m.v_dim, m.kv_lora_rank).split([m.nope_dim, m.v_dim], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def softmax_scale(hp: HParams) -> float:
    m = hp.mla
    assert m is not None, "deepseek2 hyperparameters carry their MLA shapes"
    mscale = yarn_mscale(hp.yarn.factor, m.mscale_all_dim) if hp.yarn is not None and m.mscale_all_dim else 1.0
    return mscale * mscale / (m.nope_dim + m.rope_dim) ** 0.5


def project_q(a: MLAttention, hp: HParams, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              rope_gain: float, cache: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """x `[tokens, hidden]` -> q `[tokens, heads, kv_lora_rank + rope_dim]` (its nope part moved into the latent
    space); each token's cache entry (normed latent, rotated key) stored into the layer's latent cache `[slots, 1,
    max_len, kv_lora_rank + rope_dim]` (`ops.fused.mla_qk`). `rope_gain` multiplies q's rotary part: YaRN's cos/sin
    magnitude, squared, on the q side only."""
    m, n, eps = hp.mla, x.shape[0], hp.rms_eps
    assert m is not None, "deepseek2 hyperparameters carry their MLA shapes"
    q, kv = linear(x, a.in_proj).split([a.q_rows, m.latent_dim], dim=-1)
    if a.q_b is not None:
        assert a.q_a_norm is not None, "a q LoRA comes with its norm"
        q = linear(rms_norm(q, a.q_a_norm, eps), a.q_b)
    return mla_qk(q.view(n, hp.num_heads, m.nope_dim + m.rope_dim), kv, a.k_b, a.kv_a_norm, positions, inv_freq,
                  ARCH.rope_style, eps, rope_gain, cache, slot_ids)


def project_out(a: MLAttention, out: torch.Tensor) -> torch.Tensor:
    """The attention's output in latent space `[tokens, heads, kv_lora_rank]` -> `[tokens, hidden]`."""
    return linear(mla_out(out, a.v_b), a.o)
