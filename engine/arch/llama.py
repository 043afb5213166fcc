"""Llama with experts (Mixtral): interleaved-pair RoPE on Q/K weights permuted by the GGUF converter,
softmax over the top-k logits (= renormalised top-k of the full softmax). Without experts: dense Llama."""

from engine.arch.base import ArchSpec

ARCH = ArchSpec(name="llama", rope_style="normal", qk_norm="none", norm_topk=True)
