"""Copy of one projection of each pair's expert into a staging buffer, for formats without a kernel."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import INDEX_DTYPES, check_rows, check_vector
from ops.triton.pairs import expert_pointers
from ops.triton.tables import ExpertTables


@triton.jit
def _gather_kernel(
    ptrs, expert_ids, first_pair, num_pairs,
    gate_ptrs, up_ptrs, down_ptrs, num_experts,
    out, out_stride, num_bytes, BLOCK: tl.constexpr,
):
    # program (pair of the chunk, block of BLOCK bytes); skipped pairs get zeros (zero weights)
    pair = first_pair + tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_bytes = offsets < num_bytes
    expert = tl.load(expert_ids + pair, mask=pair < num_pairs, other=-1)
    is_valid, safe, _, _, _ = expert_pointers(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs)
    addr = tl.load(ptrs + safe)
    src = tl.max_contiguous(tl.multiple_of(addr.to(tl.pointer_type(tl.uint8)) + offsets, 16), 16)
    data = tl.load(src, mask=offsets < tl.where(is_valid, num_bytes, 0), other=0)
    tl.store(out + tl.program_id(0).to(tl.int64) * out_stride + offsets, data, mask=in_bytes)


def launch_gather(ptrs: torch.Tensor, expert_ids: torch.Tensor, first_pair: int, tables: ExpertTables,
                  out: torch.Tensor, block: int = 4096) -> None:
    """out[i] = the bytes at ptrs[expert_ids[first_pair + i]] (zeros for a skipped pair).
    ptrs: one of the tables' int64 `[num_experts]`; out uint8 `[chunk, bytes of the projection]`."""
    num_pairs, device = expert_ids.shape[0], tables.device
    check_vector("ptrs", ptrs, tables.num_experts, (torch.int64,), device)
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    check_rows("out", out, (out.shape[0], out.shape[1]), (torch.uint8,), device)
    if not 0 <= first_pair <= num_pairs or out.shape[0] == 0:
        raise ValueError(f"first_pair {first_pair} and {out.shape[0]} rows do not fit {num_pairs} pairs")
    grid = (out.shape[0], triton.cdiv(out.shape[1], block))
    _gather_kernel[grid](
        ptrs, expert_ids, first_pair, num_pairs,
        tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs, tables.num_experts,
        out, out.stride(0), out.shape[1], BLOCK=block,
    )
