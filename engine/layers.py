"""Small functional pieces shared by the forward pass, the MoE block and the expert dispatchers."""

from __future__ import annotations

import torch

from engine.weights import DenseFFN
from ops.fused import gated_act, linear


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    return linear(gated_act(linear(x, ffn.gate_up), "silu"), ffn.down)


def use_device(device: torch.device) -> None:
    """Make a GPU the current device: kernels launch on the current one (a split model's ranges each on their own)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
