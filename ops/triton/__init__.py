"""Triton kernels for the GPU expert path: grouped expert FFN on raw GGUF blocks (see experts.py) and the
staging of missed experts into VRAM (stage.py)."""

from ops.triton.experts import ExpertBank, LaunchConfig, expert_ffn_triton, grouped_expert_ffn, tables_from_bank
from ops.triton.stage import stage_experts
from ops.triton.tables import ExpertTables

__all__ = ["ExpertBank", "ExpertTables", "LaunchConfig", "expert_ffn_triton", "grouped_expert_ffn",
           "stage_experts", "tables_from_bank"]
