"""Expert FFN for large batches (prefill) on tensor cores.

A prompt of a few hundred tokens selects nearly every expert of a layer, many tokens each: matrix-
matrix work, where dequantizing in the inner loop (the GEMV kernels) wastes the tensor cores. Here a
bank's experts are dequantized to bf16 a chunk of experts at a time, the (token, expert) pairs are
sorted by expert, and each projection is one grouped GEMM (`torch._grouped_mm`) over the chunk.

A CUDA bank whose three formats have tile kernels takes `ops.triton.moe_gemm` instead
(`MOECACHE_PREFILL_EXPERTS=fused`, the default; `dequant` selects the path above): the same sorted pairs, the weights
dequantized in registers inside the GEMM, nothing dequantized written to memory, no host sync. On the H200
(`.ci/gpu-moe-gemm.py`, one Qwen3-30B-A3B layer, docs/benchmarks.md) it is 1.2-1.6x the path above for Q4_K, Q6_K
and Q8_0, 3-4x for Q4_0 and MXFP4, and level for Q5_K. Other formats, other devices and other matmul dtypes keep
the path above.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F

from ops import quants
from ops.bank import ExpertWeights, gguf_experts
from ops.quants import QType

CHUNK_BYTES = 256 << 20  # dequantized weights held at once
PREFILL_EXPERTS = "MOECACHE_PREFILL_EXPERTS"
PrefillExperts = Literal["fused", "dequant"]


def prefill_experts() -> PrefillExperts:
    """`$MOECACHE_PREFILL_EXPERTS`: `fused` (`ops.triton.moe_gemm`; the default, also when empty) or `dequant`."""
    value = os.environ.get(PREFILL_EXPERTS) or "fused"
    if value not in ("fused", "dequant"):
        raise ValueError(f"{PREFILL_EXPERTS}: expected fused or dequant, got {value!r}")
    return value  # type: ignore[return-value]


def grouped_gemm_available(device: torch.device) -> bool:
    """torch's grouped GEMM: on the CPU, and on CUDA from Hopper (sm90) on."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def expert_ffn_grouped_gemm(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                            bank: ExpertWeights, dtype: torch.dtype = torch.bfloat16,
                            chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The signature of `ops.expert_ffn` (pairs with row -1 skipped) -> float32 `[tokens, hidden]`, matmuls
    in `dtype`."""
    if x.is_cuda and dtype == torch.bfloat16 and prefill_experts() == "fused":
        from ops.triton.moe_gemm import covers, expert_ffn_moe_gemm  # Triton: CUDA only

        if covers(bank):
            return expert_ffn_moe_gemm(x, token_ids, bank_rows, weights, bank)
    num_rows = bank.gate.shape[0]
    key = torch.where(bank_rows >= 0, bank_rows, num_rows)  # -1 sorts last
    order = torch.argsort(key, stable=True)
    ends = torch.bincount(key, minlength=num_rows + 1)[:num_rows].cumsum(0)
    per_token = torch.bincount(token_ids, minlength=x.shape[0])  # pairs of each token
    # NOTE: one host sync per call: the chunks' row ranges, and the most pairs of one token
    *ends_host, width = torch.cat([ends, per_token.max().view(1)]).tolist()
    rows = x.to(dtype)[token_ids[order[:ends_host[-1]]]]  # [valid pairs, hidden], sorted by bank row
    row_ids = key[order[:ends_host[-1]]]  # the bank row of each
    y = torch.empty((rows.shape[0], bank.hidden), dtype=dtype, device=x.device)
    per_chunk = max(1, chunk_bytes // (3 * bank.ff * bank.hidden * torch.empty((), dtype=dtype).element_size()))
    for first in range(0, num_rows, per_chunk):
        last = min(num_rows, first + per_chunk)
        start, stop = ends_host[first - 1] if first else 0, ends_host[last - 1]
        if stop > start:
            offs = (ends[first:last] - start).to(torch.int32)
            y[start:stop] = _chunk_ffn(rows[start:stop], row_ids[start:stop], offs, bank, first, last, dtype)
    pairs = torch.zeros((bank_rows.shape[0], bank.hidden), dtype=torch.float32, device=x.device)
    pairs[order[:rows.shape[0]]] = y.float()
    return _sum_by_token(pairs * weights.float()[:, None], token_ids, per_token, width)


def _sum_by_token(pairs: torch.Tensor, token_ids: torch.Tensor, per_token: torch.Tensor, width: int) -> torch.Tensor:
    """`[pairs, hidden]` -> `[tokens, hidden]`: each token's rows added in pair order (`per_token`: pairs of
    each token, `width`: the most of them).

    NOTE: a fixed summation order (no atomics): the same prompt gives the same bits every run. The rows
    are laid out `[tokens, width, hidden]` (zeros where a token has fewer) and summed."""
    order = torch.argsort(token_ids, stable=True)
    tokens = token_ids[order]
    rank = torch.arange(order.shape[0], device=pairs.device) - (per_token.cumsum(0) - per_token)[tokens]
    padded = torch.zeros((per_token.shape[0], width, pairs.shape[1]), dtype=pairs.dtype, device=pairs.device)
    padded[tokens, rank] = pairs[order]
    return padded.sum(1)


def _chunk_ffn(rows: torch.Tensor, row_ids: torch.Tensor, offs: torch.Tensor, bank: ExpertWeights, first: int,
               last: int, dtype: torch.dtype) -> torch.Tensor:
    """rows `[pairs, hidden]` of experts first..last-1 in order (row_ids: each one's), offs = their cumulative
    counts. The bank's math other than plain runs between the matrices in float32."""
    raw_gate, raw_up, raw_down = gguf_experts(bank, slice(first, last))
    gate = dequantize_experts(raw_gate, bank.gate_type, bank.hidden, dtype)  # [e, ff, hidden]
    up = dequantize_experts(raw_up, bank.up_type, bank.hidden, dtype)
    g, u = (torch._grouped_mm(rows, w.transpose(1, 2), offs=offs) for w in (gate, up))
    del gate, up
    math = bank.math
    h = F.silu(g) * u if math.is_plain else math.hidden(g.float(), u.float(), row_ids).to(dtype)
    down = dequantize_experts(raw_down, bank.down_type, bank.ff, dtype)  # [e, hidden, ff]
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    return y if math.is_plain else math.output(y.float(), row_ids).to(dtype)


def dequantize_experts(raw: torch.Tensor, qtype: QType, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Raw expert rows `[experts, rows, row_bytes]` -> `[experts, rows, cols]` of `dtype`, on raw's device."""
    if raw.is_cuda:
        from ops.triton.dequant import dequantize_rows  # Triton: CUDA only

        flat = dequantize_rows(raw.reshape(-1, raw.shape[-1]), qtype, cols, dtype=dtype)
        return flat.view(*raw.shape[:-1], cols)
    return quants.dequantize(raw, qtype, cols).to(dtype)
