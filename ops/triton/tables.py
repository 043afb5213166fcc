"""Per-layer pointer tables: where each expert's gate, up and down bytes are."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from ops.bank import expert_bytes
from ops.expert_math import PLAIN, ExpertMath
from ops.quants import row_bytes

QType = GGMLQuantizationType


@dataclass(frozen=True)
class ExpertTables:
    """Addresses of the raw GGUF bytes of one layer's experts, one int64 per expert and projection.

    A pointer is a VRAM slot of the cache, pinned host memory (read zero-copy over PCIe) or <= 0 for
    none; a pair whose expert has any pointer <= 0 is skipped. NOTE: each pointer is 16-byte aligned
    and addresses `rows` contiguous rows of `row_bytes(type, cols)` bytes (gate/up: ff rows of hidden
    columns; down: hidden rows of ff columns). The tables hold raw addresses: whoever builds them keeps
    the memory alive (and published) while a launch may read it."""

    gate_ptrs: torch.Tensor  # int64 [num_experts]
    up_ptrs: torch.Tensor  # int64 [num_experts]
    down_ptrs: torch.Tensor  # int64 [num_experts]
    gate_type: QType
    up_type: QType
    down_type: QType
    hidden: int
    ff: int
    math: ExpertMath = PLAIN  # biases indexed like the pointers (expert ids), on the tables' device
    planar: bool = False  # MXFP4 matrices in `ops.bank.to_planar`'s order (a resident bank's)

    def __post_init__(self) -> None:
        for name in ("gate_type", "up_type", "down_type"):
            object.__setattr__(self, name, QType(getattr(self, name)))
        num_experts = self.gate_ptrs.shape[0] if self.gate_ptrs.dim() == 1 else -1
        for name in ("gate_ptrs", "up_ptrs", "down_ptrs"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != num_experts or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous int64 [num_experts], got {t.dtype} {tuple(t.shape)}")
            if t.device != self.gate_ptrs.device:
                raise ValueError(f"{name}: on {t.device}, gate_ptrs on {self.gate_ptrs.device}")
        if self.hidden <= 0 or self.ff <= 0:
            raise ValueError(f"hidden and ff must be positive, got {self.hidden} and {self.ff}")
        if self.hidden % 16 or self.ff % 16:
            raise ValueError(f"hidden and ff must be multiples of 16, got {self.hidden} and {self.ff}")
        for qtype, cols in ((self.gate_type, self.hidden), (self.up_type, self.hidden), (self.down_type, self.ff)):
            row_bytes(qtype, cols)  # ValueError for an unknown type or a partial block

    @staticmethod
    def row_bytes_of(qtype: QType, cols: int) -> int:
        return row_bytes(qtype, cols)

    @property
    def num_experts(self) -> int:
        return self.gate_ptrs.shape[0]

    @property
    def device(self) -> torch.device:
        return self.gate_ptrs.device

    @property
    def gate_row_bytes(self) -> int:
        return row_bytes(self.gate_type, self.hidden)

    @property
    def up_row_bytes(self) -> int:
        return row_bytes(self.up_type, self.hidden)

    @property
    def down_row_bytes(self) -> int:
        return row_bytes(self.down_type, self.ff)

    @property
    def expert_bytes(self) -> int:
        return expert_bytes(self.gate_type, self.up_type, self.down_type, self.hidden, self.ff)
