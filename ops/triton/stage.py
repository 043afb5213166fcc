"""Staging of a step's missed experts into VRAM before the grouped FFN reads them.

The grouped FFN can read host experts in place (zero-copy), but it waits on each step's loads before
issuing the next and reaches half the link's speed; a plain copy kernel of 16-byte loads, every block
independent, reads pinned host memory at the link's speed. So in decode the device first copies each
missed expert from host memory to its row of a VRAM staging bank, then computes from VRAM.

Two tables describe the same experts: `src` (a VRAM slot when cached, else host memory) and `dst` (the
same slot when cached, else the expert's staging row). An expert is copied when its two pointers
differ, once per step: by the first pair that selects it. No host sync; the grid depends only on the
number of pairs, so a decode step stays one CUDA graph.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import INDEX_DTYPES, check_vector
from ops.triton.pairs import pair_is_valid, window_for
from ops.triton.tables import ExpertTables

BLOCK = 4096  # bytes per program: 256 lanes x 16-byte loads


@triton.jit
def _stage_kernel(
    src_ptrs, dst_ptrs, expert_ids, num_pairs,
    gate_ptrs, up_ptrs, down_ptrs, num_experts,
    num_bytes, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
):
    # program (pair, block of BLOCK bytes of one projection of the pair's expert)
    pair = tl.program_id(0)
    expert = tl.load(expert_ids + pair)
    is_valid = pair_is_valid(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs)
    # the first pair of the expert in its window copies it (a later window may copy it again: same bytes)
    positions = (pair // WINDOW) * WINDOW + tl.arange(0, WINDOW)
    ids = tl.load(expert_ids + positions, mask=positions < num_pairs, other=-1)
    first = tl.min(tl.where(ids == expert, positions, num_pairs), axis=0)
    safe = tl.where(is_valid, expert, 0)
    src = tl.load(src_ptrs + safe)
    dst = tl.load(dst_ptrs + safe)
    size = tl.where(is_valid & (first == pair) & (src != dst), num_bytes, 0)
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src_bytes = tl.max_contiguous(tl.multiple_of(src.to(tl.pointer_type(tl.uint8)) + offsets, 16), 16)
    dst_bytes = tl.max_contiguous(tl.multiple_of(dst.to(tl.pointer_type(tl.uint8)) + offsets, 16), 16)
    data = tl.load(src_bytes, mask=offsets < size, other=0)
    tl.store(dst_bytes, data, mask=offsets < size)


def stage_experts(expert_ids: torch.Tensor, src: ExpertTables, dst: ExpertTables) -> None:
    """Copy the bytes of every selected expert whose `src` and `dst` pointers differ, `src` -> `dst`
    (three launches, one per projection). expert_ids `[pairs]`; ids out of range or -1 are skipped."""
    num_pairs, device = expert_ids.shape[0], src.device
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    if dst.device != device or dst.num_experts != src.num_experts:
        raise ValueError(f"dst tables: {dst.num_experts} experts on {dst.device}, src {src.num_experts} on {device}")
    if (dst.gate_type, dst.up_type, dst.down_type, dst.hidden, dst.ff) != \
            (src.gate_type, src.up_type, src.down_type, src.hidden, src.ff):
        raise ValueError("dst tables describe experts of other types or shapes than src")
    if num_pairs == 0:
        return
    window = window_for(num_pairs)
    parts = ((src.gate_ptrs, dst.gate_ptrs, src.ff * src.gate_row_bytes),
             (src.up_ptrs, dst.up_ptrs, src.ff * src.up_row_bytes),
             (src.down_ptrs, dst.down_ptrs, src.hidden * src.down_row_bytes))
    for src_ptrs, dst_ptrs, num_bytes in parts:
        _stage_kernel[(num_pairs, triton.cdiv(num_bytes, BLOCK))](
            src_ptrs, dst_ptrs, expert_ids, num_pairs,
            src.gate_ptrs, src.up_ptrs, src.down_ptrs, src.num_experts,
            num_bytes, BLOCK=BLOCK, WINDOW=window,
        )
