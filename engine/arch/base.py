"""The contract every architecture module exports: hyperparameters, tensor names, routing quirks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from ops.expert_math import PLAIN, ExpertMath
from ops.qweight import Matrix

EXPERT_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's `expert_gating_func` values


@dataclass(frozen=True)
class YaRN:
    """YaRN rope scaling (arXiv:2309.00071), as HF transformers' `_compute_yarn_parameters` defines it."""

    factor: float
    orig_context: int  # the pretraining context the frequencies are stretched from
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0  # magnitude of cos and sin (HF's attention_factor)
    truncate: bool = True  # correction range rounded to whole dimensions (HF's default; llama.cpp always)


@dataclass(frozen=True)
class Routing:
    """How router logits become expert ids and weights, beyond softmax top-k."""

    gating: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int = 1  # experts split into groups; only the best `topk_groups` groups are eligible
    topk_groups: int = 1
    group_score: Literal["max", "top2"] = "top2"  # a group's score: its best expert, or its best two summed
    scale: float = 1.0  # routed_scaling_factor: multiplies the final weights

    @property
    def is_plain(self) -> bool:
        """Softmax top-k over all experts, unscaled: the fused router's case."""
        return self.gating == "softmax" and self.num_groups <= 1 and self.scale == 1.0


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): keys and values are decompressed from a
    per-token latent of `kv_lora_rank` (cached) plus one shared rotary key of `rope_dim`."""

    q_lora_rank: int  # 0: q projected from the hidden state directly
    kv_lora_rank: int
    nope_dim: int  # the head's dimensions without rotary embedding
    rope_dim: int
    v_dim: int
    mscale_all_dim: float = 0.0  # with YaRN, the softmax scale is multiplied by yarn_mscale(factor, this)^2

    @property
    def latent_dim(self) -> int:
        """Per token and layer in the KV cache: the latent and the rotary key."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class HParams:
    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    num_experts: int
    top_k: int
    expert_ff: int  # routed expert FFN width
    dense_ff: int = 0  # FFN width of dense (non-MoE) layers
    shared_ff: int = 0  # shared expert FFN width (0: none)
    rope_scale: float = 1.0  # linear position scaling
    norm_topk: bool = False  # renormalise the top-k routing weights to sum to 1
    yarn: YaRN | None = None
    routing: Routing = Routing()
    mla: MLA | None = None
    num_dense_layers: int = 0  # leading layers with a dense FFN (DeepSeek's first_k_dense_replace)
    sliding_window: int = 0  # positions a sliding-window layer attends to, its own included
    sliding_layers: tuple[int, ...] = ()  # the layers with a sliding window; the others attend to everything
    swa_head_dim: int = 0  # head size of the sliding-window layers where it differs from the others' (Gemma 4)
    swa_kv_heads: int = 0  # KV heads of the sliding-window layers where they differ
    swa_rope_theta: float = 0.0  # rope base of the sliding-window layers where it differs
    kv_shared_layers: int = 0  # the last n layers read the KV cache of the last earlier layer of their kind
    logit_softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.swa_kv_heads and self.num_heads % self.swa_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.swa_kv_heads} KV heads")
        if self.kv_shared_layers and {self.is_sliding(i) for i in range(self.num_layers)} != \
                {self.is_sliding(i) for i in range(self.num_layers - self.kv_shared_layers)}:
            raise ValueError("a kind of attention among the shared-KV layers has no earlier layer to read from")
        if self.top_k > self.num_experts:
            raise ValueError(f"top-k {self.top_k} exceeds {self.num_experts} experts")
        r = self.routing
        if r.num_groups > 1 and (self.num_experts % r.num_groups or not 0 < r.topk_groups <= r.num_groups):
            raise ValueError(f"{self.num_experts} experts in {r.num_groups} groups, {r.topk_groups} used: "
                             "invalid grouping")

    def window(self, layer: int) -> int:
        """The layer's attention window (0: the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    def head_dim_of(self, layer: int) -> int:
        return self.swa_head_dim if self.swa_head_dim and self.is_sliding(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.swa_kv_heads if self.swa_kv_heads and self.is_sliding(layer) else self.num_kv_heads

    def kv_layer(self, layer: int) -> int:
        """The layer whose KV cache `layer` reads: its own, or for a shared-KV layer the last layer before the
        shared ones with the same kind of attention (HF's `kv_sharing_modes`)."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        return max(i for i in range(first_shared) if self.is_sliding(i) == self.is_sliding(layer))

    @property
    def rope_dim(self) -> int:
        """Rotated dimensions of each q/k head."""
        return self.mla.rope_dim if self.mla else self.head_dim


def sliding_pattern(num_layers: int, pattern: int | list[bool]) -> tuple[int, ...]:
    """The sliding-window layers of GGUF's `attention.sliding_window_pattern`: one flag per layer, or n for
    every n-th layer full and the others sliding, the first n - 1 sliding (llama.cpp's `set_swa_pattern`)."""
    if isinstance(pattern, list):
        return tuple(i for i, is_sliding in enumerate(pattern) if is_sliding)
    return tuple(i for i in range(num_layers) if pattern == 0 or i % pattern < pattern - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# GGUF tensor names (llama.cpp's), per layer unless noted.
GLOBAL_TENSORS = {"embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
                  "rope_freqs": "rope_freqs.weight"}
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "o_bias": "attn_output.bias", "sinks": "attn_sinks.weight",
    "ffn_norm": "ffn_norm.weight", "post_attn_norm": "post_attention_norm.weight",
    "router": "ffn_gate_inp.weight", "router_bias": "ffn_gate_inp.bias", "score_bias": "exp_probs_b.bias",
    "gate_exps": "ffn_gate_exps.weight", "up_exps": "ffn_up_exps.weight", "down_exps": "ffn_down_exps.weight",
    "gate_exps_bias": "ffn_gate_exps.bias", "up_exps_bias": "ffn_up_exps.bias", "down_exps_bias": "ffn_down_exps.bias",
    "shared_gate_inp": "ffn_gate_inp_shexp.weight",
    "gate_shexp": "ffn_gate_shexp.weight", "up_shexp": "ffn_up_shexp.weight", "down_shexp": "ffn_down_shexp.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    # Gemma 4: norms around every block, merged gate/up experts, scales
    "post_ffn_norm": "post_ffw_norm.weight", "pre_ffn_norm_2": "pre_ffw_norm_2.weight",
    "post_ffn_norm_1": "post_ffw_norm_1.weight", "post_ffn_norm_2": "post_ffw_norm_2.weight",
    "out_scale": "layer_output_scale.weight", "router_scale": "ffn_gate_inp.scale",
    "gate_up_exps": "ffn_gate_up_exps.weight", "down_exps_scale": "ffn_down_exps.scale",
    # multi-head latent attention (deepseek2)
    "q_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "q_b": "attn_q_b.weight",
    "kv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "kv_b": "attn_kv_b.weight",
    "k_b": "attn_k_b.weight", "v_b": "attn_v_b.weight",
}


def layer_tensor(layer: int, role: str) -> str:
    return f"blk.{layer}.{LAYER_TENSORS[role]}"


class TensorSource(Protocol):
    """What an architecture module loads its own tensors from (`engine.weights.WeightLoader`)."""

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...

    def matrix(self, *parts: tuple[str, tuple[int, int]]) -> Matrix:
        """Matrices stacked by rows that are only ever multiplied by (`ops.fused.linear`): kept as Q8_0 where the
        loader keeps them (`ops.qweight`), else in the compute dtype."""
        ...

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None: ...

    def has(self, name: str) -> bool: ...

    def host(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """float32 in host memory (what lives beside the routed experts)."""
        ...


@dataclass(frozen=True)
class ArchSpec:
    name: str  # general.architecture in GGUF
    rope_style: Literal["neox", "normal"]  # neox: rotate halves; normal: rotate interleaved pairs
    qk_norm: Literal["none", "head", "full"]  # RMSNorm of q/k per head (Qwen3) or over all heads (OLMoE)
    norm_topk: bool  # the reference model's default; GGUF `{arch}.expert_weights_norm` overrides it
    attn_bias: bool = False  # q/k/v projections have biases
    shared_expert: bool = False  # a shared expert scaled by sigmoid(x . shared_gate_inp)
    yarn_truncate: bool = True  # how the reference model rounds YaRN's correction range (GGUF has no key)
    ffn_norm: str = "ffn_norm"  # the role (`LAYER_TENSORS`) of the norm before the FFN
    swa_pattern: int = 0  # sliding-window layers where GGUF names none (`sliding_pattern`; llama.cpp's default)
    qk_scale: float = 0.0  # the attention's softmax scale where it is not 1 / sqrt(head_dim) (Gemma 4: 1)
    extra_keys: Mapping[str, str] = field(default_factory=dict)

    def key(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def hparams(self, md: Mapping[str, Any], vocab_size: int) -> HParams:
        """Read hyperparameters from GGUF metadata (KeyError names the missing key)."""
        return HParams(**self.read(md, vocab_size))

    def read(self, md: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
        """`HParams` fields from the keys llama.cpp reads for every architecture; modules add their own."""
        k = self.key
        hidden = int(md[k("embedding_length")])
        num_heads = int(md[k("attention.head_count")])
        scaling = md.get(k("rope.scaling.type"), "none")
        if scaling not in ("none", "linear", "yarn"):
            raise ValueError(f"rope scaling '{scaling}' is not supported")
        return dict(
            arch=self.name,
            num_layers=int(md[k("block_count")]),
            hidden=hidden,
            num_heads=num_heads,
            num_kv_heads=int(md.get(k("attention.head_count_kv"), num_heads)),
            head_dim=int(md.get(k("attention.key_length"), hidden // num_heads)),
            vocab_size=vocab_size,
            context_length=int(md.get(k("context_length"), 4096)),
            rms_eps=float(md[k("attention.layer_norm_rms_epsilon")]),
            rope_theta=float(md.get(k("rope.freq_base"), 10000.0)),
            num_experts=int(md.get(k("expert_count"), 0)),
            top_k=int(md.get(k("expert_used_count"), 0)),
            expert_ff=int(md.get(k("expert_feed_forward_length"), md.get(k("feed_forward_length"), 0))),
            dense_ff=int(md.get(k("feed_forward_length"), 0)),
            shared_ff=int(md.get(k("expert_shared_feed_forward_length"), 0)),
            rope_scale=float(md.get(k("rope.scaling.factor"), 1.0)) if scaling == "linear" else 1.0,
            norm_topk=bool(md.get(k("expert_weights_norm"), self.norm_topk)),
            yarn=self.read_yarn(md) if scaling == "yarn" else None,
            routing=self.read_routing(md),
            **self.read_sliding(md),
        )

    def read_sliding(self, md: Mapping[str, Any]) -> dict[str, Any]:
        k = self.key
        window = int(md.get(k("attention.sliding_window"), 0))
        if not window:
            return {}
        pattern = md.get(k("attention.sliding_window_pattern"), self.swa_pattern)
        return {"sliding_window": window,
                "sliding_layers": sliding_pattern(int(md[k("block_count")]), pattern if isinstance(pattern, int)
                                                  else [bool(p) for p in pattern])}

    def read_yarn(self, md: Mapping[str, Any]) -> YaRN:
        k = self.key
        factor = float(md[k("rope.scaling.factor")])
        return YaRN(factor, int(md[k("rope.scaling.original_context_length")]),
                    float(md.get(k("rope.scaling.yarn_beta_fast"), 32.0)),
                    float(md.get(k("rope.scaling.yarn_beta_slow"), 1.0)),
                    float(md.get(k("rope.scaling.yarn_attn_factor"), yarn_mscale(factor))), self.yarn_truncate)

    def read_routing(self, md: Mapping[str, Any]) -> Routing:
        k = self.key
        gating = EXPERT_GATING.get(int(md.get(k("expert_gating_func"), 1)))
        if gating is None:
            raise ValueError(f"expert gating function {md[k('expert_gating_func')]} is not supported")
        num_groups = int(md.get(k("expert_group_count"), 1))
        return Routing(gating=gating, num_groups=num_groups,  # type: ignore[arg-type]
                       topk_groups=int(md.get(k("expert_group_used_count"), num_groups)),
                       group_score=self.group_score(gating), scale=float(md.get(k("expert_weights_scale"), 1.0)))

    def group_score(self, gating: str) -> Literal["max", "top2"]:
        return "top2"

    def extra_tensors(self, hp: HParams) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(role, shape) of the float tensors an MoE layer of this architecture has beyond the common ones
        (biases, sinks): what a random-weight model writes."""
        return ()

    def expert_math(self, src: TensorSource, layer: int, hp: HParams) -> ExpertMath:
        """What the layer's routed experts compute between their matrices (biases by expert id)."""
        return PLAIN

    def metadata(self, hp: HParams) -> dict[str, Any]:
        """The inverse of `hparams`: GGUF metadata for writing a model."""
        k = self.key
        md: dict[str, Any] = {
            "general.architecture": self.name,
            k("block_count"): hp.num_layers,
            k("context_length"): hp.context_length,
            k("embedding_length"): hp.hidden,
            k("feed_forward_length"): hp.dense_ff or hp.expert_ff,
            k("attention.head_count"): hp.num_heads,
            k("attention.head_count_kv"): hp.num_kv_heads,
            k("attention.key_length"): hp.head_dim,
            k("attention.value_length"): hp.head_dim,
            k("attention.layer_norm_rms_epsilon"): hp.rms_eps,
            k("rope.freq_base"): hp.rope_theta,
            k("expert_count"): hp.num_experts,
            k("expert_used_count"): hp.top_k,
            k("expert_feed_forward_length"): hp.expert_ff,
        }
        if self.shared_expert:
            md[k("expert_shared_feed_forward_length")] = hp.shared_ff
        if hp.norm_topk != self.norm_topk:
            md[k("expert_weights_norm")] = hp.norm_topk
        if hp.rope_scale != 1.0:
            md[k("rope.scaling.type")] = "linear"
            md[k("rope.scaling.factor")] = hp.rope_scale
        return {**md, **self.yarn_metadata(hp), **self.routing_metadata(hp), **self.sliding_metadata(hp)}

    def sliding_metadata(self, hp: HParams) -> dict[str, Any]:
        k = self.key
        if not hp.sliding_window:
            return {}
        md: dict[str, Any] = {k("attention.sliding_window"): hp.sliding_window}
        if hp.sliding_layers != sliding_pattern(hp.num_layers, self.swa_pattern):
            md[k("attention.sliding_window_pattern")] = [i in hp.sliding_layers for i in range(hp.num_layers)]
        return md

    def yarn_metadata(self, hp: HParams) -> dict[str, Any]:
        y, k = hp.yarn, self.key
        if y is None:
            return {}
        return {k("rope.scaling.type"): "yarn", k("rope.scaling.factor"): y.factor,
                k("rope.scaling.original_context_length"): y.orig_context, k("rope.scaling.yarn_beta_fast"):
                y.beta_fast, k("rope.scaling.yarn_beta_slow"): y.beta_slow}

    def routing_metadata(self, hp: HParams) -> dict[str, Any]:
        r, k = hp.routing, self.key
        md: dict[str, Any] = {}
        if r.gating != "softmax":
            md[k("expert_gating_func")] = {v: c for c, v in EXPERT_GATING.items()}[r.gating]
        if r.num_groups > 1:
            md[k("expert_group_count")], md[k("expert_group_used_count")] = r.num_groups, r.topk_groups
        if r.scale != 1.0:
            md[k("expert_weights_scale")] = r.scale
        return md
