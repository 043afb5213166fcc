"""gpt-oss (`gpt-oss` in GGUF; OpenAI's gpt-oss-20b and 120b): q/k/v and output biases,
a learned attention sink per head, sliding-window (even) and full (odd) layers, YaRN without rounding the
correction range, a router bias with the softmax over the chosen experts, and experts with biases and the
clamped SwiGLU `min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)` (MXFP4 in the released files).

Facts as HF transformers' `gpt_oss` modeling and llama.cpp's `src/models/openai-moe.cpp` define them; the
norm before the experts is `post_attention_norm` in GGUF."""

from __future__ import annotations

from dataclasses import dataclass

from engine.arch.base import ArchSpec, HParams, TensorSource, layer_tensor
from ops.expert_math import ExpertMath

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's constants, HF's config defaults


@dataclass(frozen=True)
class GptOssSpec(ArchSpec):
    def extra_tensors(self, hp: HParams) -> tuple[tuple[str, tuple[int, ...]], ...]:
        e, ff = hp.num_experts, hp.expert_ff
        return (("o_bias", (hp.hidden,)), ("sinks", (hp.num_heads,)), ("router_bias", (e,)),
                ("gate_exps_bias", (e, ff)), ("up_exps_bias", (e, ff)), ("down_exps_bias", (e, hp.hidden)))

    def expert_math(self, src: TensorSource, layer: int, hp: HParams) -> ExpertMath:
        e, t = hp.num_experts, lambda role: layer_tensor(layer, role)
        return ExpertMath("swiglu_oai", src.host(t("gate_exps_bias"), (e, hp.expert_ff)),
                          src.host(t("up_exps_bias"), (e, hp.expert_ff)), src.host(t("down_exps_bias"), (e, hp.hidden)),
                          SWIGLU_ALPHA, SWIGLU_LIMIT)


# NOTE: softmax over the chosen experts' logits equals the renormalised top-k of the full softmax (norm_topk)
ARCH = GptOssSpec(name="gpt-oss", rope_style="neox", qk_norm="none", norm_topk=True, attn_bias=True,
                  yarn_truncate=False, ffn_norm="post_attn_norm", swa_pattern=2)
