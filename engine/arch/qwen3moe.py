"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k RMSNorm per head, NeoX RoPE, top-k renormalised."""

from engine.arch.base import ArchSpec

ARCH = ArchSpec(name="qwen3moe", rope_style="neox", qk_norm="head", norm_topk=True)
