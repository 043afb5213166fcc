"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases and a shared expert behind a sigmoid gate;
top-k weights are not renormalised."""

from engine.arch.base import ArchSpec

ARCH = ArchSpec(name="qwen2moe", rope_style="neox", qk_norm="none", norm_topk=False, attn_bias=True,
                shared_expert=True)
