"""Small functional pieces shared by the forward pass and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.weights import DenseFFN


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, ffn.gate)) * F.linear(x, ffn.up), ffn.down)
