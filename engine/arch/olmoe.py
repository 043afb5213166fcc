"""OLMoE: q/k RMSNorm over all heads at once (before the head split), NeoX RoPE, top-k not renormalised."""

from engine.arch.base import ArchSpec

ARCH = ArchSpec(name="olmoe", rope_style="neox", qk_norm="full", norm_topk=False)
