"""Triton kernels for the GPU expert path: grouped expert FFN on raw GGUF blocks (see experts.py)."""

from ops.triton.experts import ExpertBank, LaunchConfig, expert_ffn_triton, grouped_expert_ffn, tables_from_bank
from ops.triton.tables import ExpertTables

__all__ = ["ExpertBank", "ExpertTables", "LaunchConfig", "expert_ffn_triton", "grouped_expert_ffn",
           "tables_from_bank"]
