"""Small functional pieces shared by the forward pass and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.weights import DenseFFN


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    gate, up = F.linear(x, ffn.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, ffn.down)
