"""Down projection of grouped expert pairs plus the expert's down bias (if any), scaled by the routing weight:
y `[pairs, hidden]`."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_vector
from ops.triton.gate_up import bias_rows, warps_for
from ops.triton.pairs import chunk_of, expert_pointers, group_of, slots, window_for
from ops.triton.qdot import GROUP, MAGIC, has_kernel, kernel_format, rows_dot, step_blocks
from ops.triton.stage import COPY_BLOCK, Fill, fill_rows
from ops.triton.tables import ExpertTables


@triton.jit
def _store_y(y, y_stride, position, has, weights, rows, rmask, acc, bias, BIAS: tl.constexpr):
    weight = tl.load(weights + position, mask=has, other=0.0).to(tl.float32)
    if BIAS:
        acc += bias
    tl.store(y + position.to(tl.int64) * y_stride + rows, weight * acc, mask=tl.where(has, rmask, False))


@triton.jit
def _down_kernel(
    h, h_stride, hs, hs_stride, expert_ids, weights, num_pairs,
    gate_ptrs, up_ptrs, down_ptrs, num_experts, down_row_bytes,
    y, y_stride, hidden, magic, fill_flags, host_down_ptrs, down_biases,
    DOWN_FMT: tl.constexpr, FF: tl.constexpr,
    BT: tl.constexpr, BR: tl.constexpr, WINDOW: tl.constexpr, FILL: tl.constexpr, SPREAD: tl.constexpr,
    COPY: tl.constexpr,
    BIAS: tl.constexpr, BLOCKS: tl.constexpr,
):
    # program (pair position, block of BR rows of hidden); only the pairs that lead a chunk of their group work
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    rmask = rows < hidden
    safe_rows = tl.minimum(rows, hidden - 1)  # loads stay inside the expert; stores are masked
    expert = tl.load(expert_ids + pid)
    is_valid, safe, _gate, _up, down_addr = expert_pointers(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs)
    filling = False
    if FILL:
        filling = tl.load(fill_flags + safe) != 0  # in flight with the pointers
    spread = SPREAD
    if FILL:
        spread = SPREAD & (filling == 0)  # NOTE: a streamed expert is copied once, by the one program that computes it
    positions, is_member, rank, first, end = group_of(expert_ids, num_pairs, pid, expert, is_valid, spread, BT, WINDOW)
    bias = 0.0
    if BIAS:  # the expert's row of the biases `[experts, hidden]`
        bias = tl.load(down_biases + safe.to(tl.int64) * hidden + safe_rows)
    if FILL:
        if filling & (end > first):  # the leader of a streamed miss first copies the rows it computes
            row0 = tl.program_id(1) * BR
            fill_rows(host_down_ptrs, down_addr, safe, row0, tl.minimum(hidden - row0, BR), down_row_bytes, COPY)
            tl.debug_barrier()  # NOTE: the rows are in VRAM before any thread of the program reads them
    # a skipped pair's row is 0, so that every row of y is written and the per-token sum needs no
    # table lookups
    skipped = y + pid.to(tl.int64) * y_stride + rows
    tl.store(skipped, tl.zeros([BR], tl.float32), mask=tl.where(is_valid, False, rmask))
    for start in range(first, end, BT):
        position, has = chunk_of(positions, is_member, rank, start, BT)
        p0, p1, p2, p3 = slots(position.to(tl.int64), BT)  # empty slots: position 0, a valid row
        h0, h1, h2, h3 = slots(has.to(tl.int32), BT)
        a0, a1, a2, a3, _, _, _, _ = rows_dot(
            down_addr, down_addr, safe_rows, down_row_bytes,
            h + p0 * h_stride, h + p1 * h_stride, h + p2 * h_stride, h + p3 * h_stride,
            hs + p0 * hs_stride, hs + p1 * hs_stride, hs + p2 * hs_stride, hs + p3 * hs_stride,
            magic, DOWN_FMT, FF, BT, False, BLOCKS)
        _store_y(y, y_stride, p0, h0 > 0, weights, rows, rmask, a0, bias, BIAS)
        if BT > 1:
            _store_y(y, y_stride, p1, h1 > 0, weights, rows, rmask, a1, bias, BIAS)
        if BT > 2:
            _store_y(y, y_stride, p2, h2 > 0, weights, rows, rmask, a2, bias, BIAS)
            _store_y(y, y_stride, p3, h3 > 0, weights, rows, rmask, a3, bias, BIAS)


def launch_down(h: torch.Tensor, h_sums: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                tables: ExpertTables, y: torch.Tensor, block_tokens: int = 1, block_rows: int = 32,
                num_warps: int | None = None, fill: Fill | None = None, blocks: int = 0, spread: bool = True) -> None:
    """y[p] = weights[p] * (down_e(h[p]) + the tables' down bias of e) for each computed pair p, 0 for a skipped
    pair. h float32
    `[pairs, ff]` prepared for the down format (`prepare.launch_prepare`), h_sums `[pairs, ff // 16]`
    its natural sums; expert_ids, weights `[pairs]`; y float32 `[pairs, hidden]`. With `fill`, the down rows of
    experts whose flag is set are first copied from host memory (`ops.triton.stage`). blocks: the 32-block formats'
    blocks a step (`qdot.step_blocks`, 0: its default); spread: an expert's pairs over programs (`pairs`)."""
    if not has_kernel(tables.down_type):
        raise ValueError(f"no down kernel for {tables.down_type.name}")
    num_pairs, device = expert_ids.shape[0], tables.device
    check_rows("h", h, (num_pairs, tables.ff), (torch.float32,), device)
    if h.stride(0) % 4 or h.data_ptr() % 16:
        raise ValueError("h: rows must be 16-byte aligned")
    check_rows("h_sums", h_sums, (num_pairs, tables.ff // GROUP), (torch.float32,), device)
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    check_vector("weights", weights, num_pairs, FLOAT_DTYPES, device)
    check_rows("y", y, (num_pairs, tables.hidden), (torch.float32,), device)
    if block_tokens not in (1, 2, 4) or block_rows < 1 or triton.next_power_of_2(block_rows) != block_rows:
        raise ValueError(f"need block_tokens in 1, 2, 4 and block_rows a power of two, "
                         f"got {block_tokens}, {block_rows}")
    if fill is not None:
        fill.check(tables)
    if num_pairs == 0:
        return
    down_bias = tables.math.down_bias
    biases = y if down_bias is None else bias_rows(down_bias, tables.num_experts, tables.hidden, device)
    grid = (num_pairs, triton.cdiv(tables.hidden, block_rows))
    _down_kernel[grid](
        h, h.stride(0), h_sums, h_sums.stride(0), expert_ids, weights, num_pairs,
        tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs, tables.num_experts, tables.down_row_bytes,
        y, y.stride(0), tables.hidden, MAGIC,
        fill.flags if fill is not None else expert_ids, (fill.host if fill is not None else tables).down_ptrs, biases,
        DOWN_FMT=kernel_format(tables.down_type, tables.planar), FF=tables.ff,
        BT=block_tokens, BR=block_rows, WINDOW=window_for(num_pairs, block_tokens, spread, fill is not None),
        FILL=fill is not None, SPREAD=spread, COPY=COPY_BLOCK, BIAS=down_bias is not None,
        BLOCKS=step_blocks(tables.ff, blocks, tables.down_type),
        num_warps=num_warps or warps_for(block_rows),
    )
