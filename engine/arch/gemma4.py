"""Gemma 4 (`gemma4` in GGUF; 26B-A4B is its MoE). Facts as llama.cpp's `src/models/gemma4.cpp` and HF
transformers' `gemma4` modeling define them:

- embeddings scaled by sqrt(hidden); RMSNorm before and after every block ("sandwich"), the residual
  stream multiplied by the layer's output scale at the end of the layer; final logits soft-capped;
- sliding-window layers (head size `key_length_swa`, rope base `freq_base_swa`) and full-attention layers
  (wider heads, fewer KV heads, rope base `freq_base` with proportional rope: `rope_freqs` divides the
  frequencies, 1e30 for the dimensions that do not rotate); q and k RMS-normed per head with weights, v
  without; the attention scale is 1; a full layer without a v projection uses its keys as values;
- shared-KV layers (the last `shared_kv_layers`) read the cache of the last earlier layer of their kind;
- every layer has a dense GELU MLP; an MoE layer adds routed GELU experts (merged gate/up in GGUF) on
  their own norm of the residual, routed from `rms_norm(x) * ffn_gate_inp.scale / sqrt(hidden)`, softmax
  top-k renormalised, each expert's output scaled by `ffn_down_exps.scale`; both outputs post-normed and
  summed.

Per-layer embeddings (the E2B / E4B models) are not supported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.arch.base import ArchSpec, HParams, TensorSource, layer_tensor
from ops.expert_math import ExpertMath
from ops.fused import gated_act, linear, qk_norm_rope, rms_norm
from ops.qweight import Matrix

GELU = ExpertMath("gelu")


@dataclass(frozen=True)
class Gemma4Spec(ArchSpec):
    def read(self, md: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
        k, num_layers = self.key, int(md[self.key("block_count")])
        if int(md.get(k("embedding_length_per_layer_input"), 0)):
            raise ValueError("Gemma 4 with per-layer embeddings (E2B, E4B) is not supported")
        kv_heads = md.get(k("attention.head_count_kv"), md[k("attention.head_count")])
        per_layer = list(kv_heads) if isinstance(kv_heads, list) else [kv_heads] * num_layers
        fields = super().read({**md, k("attention.head_count_kv"): 0}, vocab_size)
        sliding = fields.get("sliding_layers", ())
        full_kv = [int(n) for i, n in enumerate(per_layer) if i not in sliding] or [int(per_layer[0])]
        swa_kv = [int(n) for i, n in enumerate(per_layer) if i in sliding] or full_kv
        if len(set(full_kv)) > 1 or len(set(swa_kv)) > 1:
            raise ValueError(f"KV heads per layer {per_layer}: one count per kind of layer is supported")
        head_dim = int(md[k("attention.key_length")])
        return {**fields, "num_kv_heads": full_kv[0], "head_dim": head_dim,
                "swa_kv_heads": swa_kv[0], "swa_head_dim": int(md.get(k("attention.key_length_swa"), head_dim)),
                "swa_rope_theta": float(md.get(k("rope.freq_base_swa"), fields["rope_theta"])),
                "kv_shared_layers": int(md.get(k("attention.shared_kv_layers"), 0)),
                "logit_softcap": float(md.get(k("final_logit_softcapping"), 0.0)), "norm_topk": True}

    def metadata(self, hp: HParams) -> dict[str, Any]:
        k, swa_dim = self.key, hp.swa_head_dim or hp.head_dim
        return {**super().metadata(hp),
                k("feed_forward_length"): hp.dense_ff,
                k("attention.head_count_kv"): [hp.kv_heads_of(i) for i in range(hp.num_layers)],
                k("attention.key_length_swa"): swa_dim, k("attention.value_length_swa"): swa_dim,
                k("rope.dimension_count"): hp.head_dim, k("rope.dimension_count_swa"): swa_dim,
                k("rope.freq_base_swa"): hp.swa_rope_theta or hp.rope_theta,
                k("attention.shared_kv_layers"): hp.kv_shared_layers,
                k("embedding_length_per_layer_input"): 0,
                k("attention.sliding_window_pattern"): [hp.is_sliding(i) for i in range(hp.num_layers)],
                **({k("final_logit_softcapping"): hp.logit_softcap} if hp.logit_softcap else {})}

    def expert_math(self, src: TensorSource, layer: int, hp: HParams) -> ExpertMath:
        return GELU


ARCH = Gemma4Spec(name="gemma4", rope_style="neox", qk_norm="head", norm_topk=True, qk_scale=1.0)


@dataclass(frozen=True)
class GemmaAttention:
    qkv: Matrix  # [(heads + kv_heads (+ kv_heads)) * head_dim, hidden]: q, k, and v where the layer has one
    o: Matrix  # [hidden, heads * head_dim]
    num_heads: int
    num_kv_heads: int  # 0: a shared-KV layer (q only)
    head_dim: int
    has_v: bool
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor | None
    v_norm: torch.Tensor  # ones [head_dim]: values are RMS-normed without a weight


@dataclass(frozen=True)
class Sandwich:
    """Gemma 4's norms around a layer's blocks, its dense MLP beside the experts, and its output scale."""

    post_attn_norm: torch.Tensor
    post_ffn_norm: torch.Tensor
    out_scale: float  # the residual stream is multiplied by it at the end of the layer
    mlp: DenseMLP | None = None  # an MoE layer's dense MLP (a dense layer's is its FFN)
    post_mlp_norm: torch.Tensor | None = None  # MoE layers: after the dense MLP,
    pre_experts_norm: torch.Tensor | None = None  # before the experts,
    post_experts_norm: torch.Tensor | None = None  # and after them


@dataclass(frozen=True)
class DenseMLP:
    gate_up: Matrix  # [2 * ff, hidden]: gate, then up
    down: Matrix  # [hidden, ff]


def gelu_mlp(x: torch.Tensor, mlp: Any) -> torch.Tensor:
    """`down(gelu_tanh(gate x) * up x)` of any FFN with stacked gate/up and down matrices."""
    return linear(gated_act(linear(x, mlp.gate_up), "gelu"), mlp.down)


def load_attention(src: TensorSource, i: int, hp: HParams) -> GemmaAttention:
    t, hd = (lambda role: layer_tensor(i, role)), hp.head_dim_of(i)
    q_dim = hp.num_heads * hd
    owns_kv = hp.kv_layer(i) == i
    kv_heads = hp.kv_heads_of(i) if owns_kv else 0
    parts = [(t("q"), (q_dim, hp.hidden))]
    if owns_kv:
        parts.append((t("k"), (kv_heads * hd, hp.hidden)))
    has_v = owns_kv and src.has(t("v"))
    if has_v:
        parts.append((t("v"), (kv_heads * hd, hp.hidden)))
    q_norm = src.dense(t("q_norm"), (hd,))
    return GemmaAttention(src.matrix(*parts), src.matrix((t("o"), (hp.hidden, q_dim))), hp.num_heads, kv_heads, hd,
                          has_v,
                          q_norm, src.dense(t("k_norm"), (hd,)) if owns_kv else None, torch.ones_like(q_norm))


def load_sandwich(src: TensorSource, i: int, hp: HParams, is_moe: bool) -> Sandwich:
    t = lambda role: layer_tensor(i, role)  # noqa: E731
    norm = lambda role: src.dense(t(role), (hp.hidden,))  # noqa: E731
    scale = src.host(t("out_scale"), (1,)).item() if src.has(t("out_scale")) else 1.0
    if not is_moe:
        return Sandwich(norm("post_attn_norm"), norm("post_ffn_norm"), scale)
    ff = hp.dense_ff
    mlp = DenseMLP(src.matrix((t("gate"), (ff, hp.hidden)), (t("up"), (ff, hp.hidden))),
                   src.matrix((t("down"), (hp.hidden, ff))))
    return Sandwich(norm("post_attn_norm"), norm("post_ffn_norm"), scale, mlp, norm("post_ffn_norm_1"),
                    norm("pre_ffn_norm_2"), norm("post_ffn_norm_2"))


def router_norm(src: TensorSource, i: int, hp: HParams) -> torch.Tensor:
    """The router's input is `rms_norm(x) * scale / sqrt(hidden)`: one RMSNorm with that weight."""
    return src.dense(layer_tensor(i, "router_scale"), (hp.hidden,)) * hp.hidden ** -0.5


def project(a: GemmaAttention, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x `[tokens, hidden]` -> q `[tokens, heads, head_dim]` and the layer's k and v `[tokens, kv_heads,
    head_dim]` (None for a shared-KV layer): normed, q and k rotated."""
    n, hd = x.shape[0], a.head_dim
    qkv = linear(x, a.qkv)
    if not a.num_kv_heads:
        q = qk_norm_rope(qkv.view(n, a.num_heads, hd), a.q_norm, positions, inv_freq, ARCH.rope_style, eps)
        return q, None, None
    heads = a.num_heads + a.num_kv_heads
    qk = qk_norm_rope(qkv[:, :heads * hd].view(n, heads, hd), a.q_norm, positions, inv_freq, ARCH.rope_style, eps,
                      a.k_norm, a.num_heads)
    # NOTE: without a v projection the values are the keys before their norm and rotation
    v = qkv[:, heads * hd:] if a.has_v else qkv[:, a.num_heads * hd:heads * hd]
    v = v.contiguous().view(n, a.num_kv_heads, hd)  # a column slice of the projection: rows made whole for the norm
    return qk[:, :a.num_heads], qk[:, a.num_heads:], rms_norm(v, a.v_norm, eps)


def ffn_norms(ffn_norm: torch.Tensor, ffn: Any, s: Sandwich) -> tuple[torch.Tensor, ...]:
    """The norms of the residual stream a layer's FFN block reads: its dense MLP's, and in an MoE layer the experts'
    and the router's (`router_norm`)."""
    if s.pre_experts_norm is None:
        return (ffn_norm,)
    assert ffn.router_norm is not None, "an MoE layer's router reads its own norm"
    return ffn_norm, s.pre_experts_norm, ffn.router_norm
