"""Triton kernels for the GPU expert path: grouped expert FFN on raw GGUF blocks (see experts.py), the
copy of streamed misses into VRAM (stage.py) and the expert cache's device-side steps (cache_step.py)."""

from ops.triton.experts import LaunchConfig, expert_ffn_triton, grouped_expert_ffn, tables_from_bank
from ops.triton.stage import Fill, fill_experts, gather_experts, hold, hold_fills
from ops.triton.tables import ExpertTables

__all__ = ["ExpertTables", "Fill", "LaunchConfig", "expert_ffn_triton", "fill_experts", "gather_experts",
           "grouped_expert_ffn", "hold", "hold_fills", "tables_from_bank"]
