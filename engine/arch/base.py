"""The contract every architecture module exports: hyperparameters, tensor names, routing quirks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.top_k > self.num_experts:
            raise ValueError(f"top-k {self.top_k} exceeds {self.num_experts} experts")


# GGUF tensor names (llama.cpp's), per layer unless noted.
GLOBAL_TENSORS = {"embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "router": "ffn_gate_inp.weight",
    "gate_exps": "ffn_gate_exps.weight", "up_exps": "ffn_up_exps.weight", "down_exps": "ffn_down_exps.weight",
    "shared_gate_inp": "ffn_gate_inp_shexp.weight",
    "gate_shexp": "ffn_gate_shexp.weight", "up_shexp": "ffn_up_shexp.weight", "down_shexp": "ffn_down_shexp.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}


def layer_tensor(layer: int, role: str) -> str:
    return f"blk.{layer}.{LAYER_TENSORS[role]}"


@dataclass(frozen=True)
class ArchSpec:
    name: str  # general.architecture in GGUF
    rope_style: Literal["neox", "normal"]  # neox: rotate halves; normal: rotate interleaved pairs
    qk_norm: Literal["none", "head", "full"]  # RMSNorm of q/k per head (Qwen3) or over all heads (OLMoE)
    norm_topk: bool  # the reference model's default; GGUF `{arch}.expert_weights_norm` overrides it
    attn_bias: bool = False  # q/k/v projections have biases
    shared_expert: bool = False  # a shared expert scaled by sigmoid(x . shared_gate_inp)
    extra_keys: Mapping[str, str] = field(default_factory=dict)

    def key(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def hparams(self, md: Mapping[str, Any], vocab_size: int) -> HParams:
        """Read hyperparameters from GGUF metadata (KeyError names the missing key)."""
        k = self.key
        hidden = int(md[k("embedding_length")])
        num_heads = int(md[k("attention.head_count")])
        head_dim = int(md.get(k("attention.key_length"), hidden // num_heads))
        scaling = md.get(k("rope.scaling.type"), "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"rope scaling '{scaling}' is not supported")
        return HParams(
            arch=self.name,
            num_layers=int(md[k("block_count")]),
            hidden=hidden,
            num_heads=num_heads,
            num_kv_heads=int(md.get(k("attention.head_count_kv"), num_heads)),
            head_dim=head_dim,
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
        )

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
        return md
