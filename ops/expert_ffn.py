"""Grouped expert FFN over a bank of raw GGUF experts, in plain torch on any device.

A bank is an `ExpertWeights` whose first dimension indexes experts: a layer's experts in host memory,
a layer resident on the device, or a pool of cache slots. Every (token, expert) pair is one row of
`token_ids`/`bank_rows`/`weights`; the result is `out[t] = sum_p w_p * down(silu(gate(x_t)) * up(x_t))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.cpu_experts import ExpertWeights, expert_ffn_cpu, load_native
from ops.quants import dequantize


def dequantize_expert(bank: ExpertWeights, row: int, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate `[ff, hidden]`, up `[ff, hidden]`, down `[hidden, ff]` of one bank row."""
    return (dequantize(bank.gate[row], bank.gate_type, bank.hidden).to(device, dtype),
            dequantize(bank.up[row], bank.up_type, bank.hidden).to(device, dtype),
            dequantize(bank.down[row], bank.down_type, bank.ff).to(device, dtype))


def swiglu_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def expert_ffn_torch(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                     bank: ExpertWeights) -> torch.Tensor:
    """x `[tokens, hidden]`; token_ids, bank_rows, weights `[pairs]` -> float32 `[tokens, hidden]`.
    Pairs whose bank row is -1 are skipped. Dequantizes each used bank row once: the reference for
    every faster path."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    rows, inverse = bank_rows.unique(return_inverse=True)
    for index, row in enumerate(rows.tolist()):
        if row < 0:
            continue
        pairs = (inverse == index).nonzero()[:, 0]
        tokens = token_ids[pairs]
        y = swiglu_expert(x[tokens].float(), *dequantize_expert(bank, row, x.device))
        out.index_add_(0, tokens, y * weights[pairs, None].float())
    return out


def native_supports(bank: ExpertWeights) -> bool:
    native = load_native()
    return native is not None and native.supports(bank)


def expert_ffn(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
               bank: ExpertWeights) -> torch.Tensor:
    """The fastest available path for the device of `x`; pairs with bank row -1 are skipped."""
    if x.device.type == "cpu" and native_supports(bank):
        keep = bank_rows >= 0
        return expert_ffn_cpu(x.float(), token_ids[keep], bank_rows[keep], weights[keep].float(), bank)
    return expert_ffn_torch(x, token_ids, bank_rows, weights, bank)
