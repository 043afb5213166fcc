"""Small functional pieces shared by the forward pass and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.weights import DenseFFN
from ops.fused import gated_act


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    return F.linear(gated_act(F.linear(x, ffn.gate_up), "silu"), ffn.down)
