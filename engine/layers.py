"""Small functional pieces shared by the forward pass and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.weights import DenseFFN


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(x: torch.Tensor, ffn: DenseFFN) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, ffn.gate)) * F.linear(x, ffn.up), ffn.down)
