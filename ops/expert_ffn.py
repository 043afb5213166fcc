"""The expert FFN over a bank of raw GGUF experts (`ops.bank.ExpertWeights`): one signature, one torch
reference, and the fast paths behind it.

    ffn(x, token_ids, bank_rows, weights, bank) -> float32 [tokens, hidden]

x `[tokens, hidden]`; token_ids, bank_rows, weights `[pairs]`: pair p adds
`weights[p] * down_r(silu(gate_r(x_t)) * up_r(x_t))` to token t = token_ids[p], for bank row r = bank_rows[p],
or what the bank's `ExpertMath` says between the matrices (biases, another activation). Pairs whose row is
-1 are skipped.

- `expert_ffn_reference`: plain torch, each used row dequantized once by `ops.quants`: the oracle every
  path is tested against.
- `ops.cpu_experts.expert_ffn_cpu`: the native CPU kernel on a host bank, its math included (torch row tiles where
  no C compiler is present); it takes valid rows only, so `expert_ffn` drops the skipped pairs before it.
- `ops.triton.expert_ffn_triton`: the grouped GEMV kernels on CUDA, for a bank in VRAM or pinned host
  memory. Its launcher `ops.triton.grouped_expert_ffn` reads pointer tables instead of a bank: the expert
  cache's slots are one.
- `ops.grouped_gemm.expert_ffn_grouped_gemm`: grouped GEMMs on tensor cores, for large batches (prefill): on CUDA
  `ops.triton.moe_gemm`'s GEMMs that dequantize their weight tiles in registers (`MOECACHE_PREFILL_EXPERTS=dequant`:
  bf16 weights dequantized a chunk of experts at a time).
- `expert_ffn`: the path for x's device.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ops.bank import ExpertWeights, gguf_experts
from ops.cpu_experts import expert_ffn_cpu, load_native
from ops.quants import dequantize


class ExpertFFN(Protocol):
    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                 bank: ExpertWeights) -> torch.Tensor:
        """x `[tokens, hidden]`; token_ids, bank_rows, weights `[pairs]` -> float32 `[tokens, hidden]`."""
        ...


def dequantize_expert(bank: ExpertWeights, row: int, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate `[ff, hidden]`, up `[ff, hidden]`, down `[hidden, ff]` of one bank row."""
    gate, up, down = (t[0] for t in gguf_experts(bank, slice(row, row + 1)))
    return (dequantize(gate, bank.gate_type, bank.hidden).to(device, dtype),
            dequantize(up, bank.up_type, bank.hidden).to(device, dtype),
            dequantize(down, bank.down_type, bank.ff).to(device, dtype))


def bank_expert(x: torch.Tensor, bank: ExpertWeights, row: int) -> torch.Tensor:
    """x float32 `[n, hidden]` through bank row `row` on x's device -> float32 `[n, hidden]`."""
    gate, up, down = dequantize_expert(bank, row, x.device)
    rows = torch.full((x.shape[0],), row, dtype=torch.int64, device=x.device)
    math = bank.math
    return math.output(F.linear(math.hidden(F.linear(x, gate), F.linear(x, up), rows), down), rows)


def expert_ffn_reference(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                         bank: ExpertWeights) -> torch.Tensor:
    """The reference: float32 matmuls on each used bank row, dequantized once; on x's device, from a bank
    anywhere."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    rows, inverse = bank_rows.unique(return_inverse=True)
    for index, row in enumerate(rows.tolist()):
        if row < 0:
            continue
        pairs = (inverse == index).nonzero()[:, 0]
        tokens = token_ids[pairs]
        y = bank_expert(x[tokens].float(), bank, row)
        out.index_add_(0, tokens, y * weights[pairs, None].float())
    return out


def native_supports(bank: ExpertWeights) -> bool:
    native = load_native()
    return native is not None and native.supports(bank)


def expert_ffn(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
               bank: ExpertWeights) -> torch.Tensor:
    """The path for x's device: the native kernel on the CPU, the Triton kernels on CUDA, else the
    reference (a type the native kernel lacks, another device)."""
    if x.device.type == "cpu" and native_supports(bank):
        keep = bank_rows >= 0
        return expert_ffn_cpu(x.float(), token_ids[keep], bank_rows[keep], weights[keep].float(), bank)
    if x.device.type == "cuda":
        from ops.triton import expert_ffn_triton  # Triton: CUDA only

        return expert_ffn_triton(x, token_ids, bank_rows, weights, bank)
    return expert_ffn_reference(x, token_ids, bank_rows, weights, bank)
