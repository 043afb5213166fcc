"""Small functional pieces shared by the forward pass and the MoE block."""

from __future__ import annotations

import torch

from engine.weights import DenseFFN
from ops.fused import gated_act, linear


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    return linear(gated_act(linear(x, ffn.gate_up), "silu"), ffn.down)
