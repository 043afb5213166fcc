"""Copying missed experts from host memory into VRAM inside the expert kernels, and as a launch of its own.

The grouped FFN could read host experts in place (zero-copy), but its loads wait on each other and
reach half the link's speed; plain copies of 16-byte loads with many in flight reach the link's
speed. So a step's streamed misses are copied first: the program that computes rows r0..r1 of an
expert copies exactly those rows into the expert's VRAM address (`copy_span`), then computes from
VRAM. The programs of hits and of misses run in the same launch, so the hits' compute overlaps the
misses' copies. `fill_experts` is the separate launch, for formats whose FFN has no fused kernel;
`gather_experts` copies a list of experts from any addresses into one bank (a prompt's staged layer).

`hold_fills` and `hold` keep a stream busy for a time (a clock spin): a slower host link simulated on a
fast one (`--link-gbps`), as the extra time each copy would take.

Which experts to copy is a flag per expert (`Fill.flags`, set by `ops.cache_step.assign_experts`); the
source is the host table, the destination the table the FFN reads. No host sync; the grid depends only
on the number of pairs, so a decode step stays one CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import INDEX_DTYPES, check_vector
from ops.triton.pairs import expert_pointers, window_for
from ops.triton.tables import ExpertTables

COPY_BLOCK = 4096  # bytes a program has in flight per iteration: 16-byte loads, 2 per thread of 4 warps


@dataclass(frozen=True)
class Fill:
    """Experts a launch copies from host memory to the addresses of its tables before reading them."""

    flags: torch.Tensor  # int8 [num_experts]: nonzero = copy this step
    host: ExpertTables  # where their bytes are (same types and shapes as the tables read)

    def check(self, tables: ExpertTables) -> None:
        check_vector("fill flags", self.flags, tables.num_experts, (torch.int8,), tables.device)
        if self.host.device != tables.device or self.host.num_experts != tables.num_experts or \
                (self.host.gate_type, self.host.up_type, self.host.down_type, self.host.hidden, self.host.ff) != \
                (tables.gate_type, tables.up_type, tables.down_type, tables.hidden, tables.ff):
            raise ValueError("fill: the host tables describe other experts than the tables read")
        if tables.planar or self.host.planar:
            raise ValueError("fill: planar experts are resident, never copied a row range at a time")


@triton.jit
def _bytes_at(address):
    """An int64 address (16-byte aligned) as a byte pointer."""
    return tl.multiple_of(address.to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def copy_span(src, dst, num_bytes, BLOCK: tl.constexpr):
    """Copy `num_bytes` from address `src` to address `dst` (both int64, 16-byte aligned)."""
    offsets = tl.arange(0, BLOCK)
    src_bytes = tl.multiple_of(src.to(tl.pointer_type(tl.uint8)), 16)
    dst_bytes = tl.multiple_of(dst.to(tl.pointer_type(tl.uint8)), 16)
    for start in range(0, num_bytes, BLOCK):
        o = start + offsets
        data = tl.load(src_bytes + o, mask=o < num_bytes, other=0)
        tl.store(dst_bytes + o, data, mask=o < num_bytes)


@triton.jit
def fill_rows(src_ptrs, dst, expert, row0, num_rows, row_bytes, BLOCK: tl.constexpr):
    """Rows row0 .. row0 + num_rows - 1 of `expert`'s matrix from its host address to `dst`, its table
    address. Called, where the expert's fill flag is set, by the one program that computes those rows, before
    it reads them."""
    offset = row0.to(tl.int64) * row_bytes
    copy_span(tl.load(src_ptrs + expert) + offset, dst + offset, num_rows * row_bytes, BLOCK)


@triton.jit
def fill_rows2(src_a, dst_a, src_b, dst_b, expert, row0, num_rows, row_bytes_a, row_bytes_b, BLOCK: tl.constexpr):
    """`fill_rows` of two matrices of the expert (gate and up), their loads in flight together."""
    offsets = tl.arange(0, BLOCK)
    size_a, size_b = num_rows * row_bytes_a, num_rows * row_bytes_b
    sa = _bytes_at(tl.load(src_a + expert) + row0.to(tl.int64) * row_bytes_a)
    da = _bytes_at(dst_a + row0.to(tl.int64) * row_bytes_a)
    sb = _bytes_at(tl.load(src_b + expert) + row0.to(tl.int64) * row_bytes_b)
    db = _bytes_at(dst_b + row0.to(tl.int64) * row_bytes_b)
    for start in range(0, tl.maximum(size_a, size_b), BLOCK):
        o = start + offsets
        a = tl.load(sa + o, mask=o < size_a, other=0)
        b = tl.load(sb + o, mask=o < size_b, other=0)
        tl.store(da + o, a, mask=o < size_a)
        tl.store(db + o, b, mask=o < size_b)


@triton.jit
def _fill_kernel(
    flags, src_ptrs, dst_ptrs, expert_ids, num_pairs,
    gate_ptrs, up_ptrs, down_ptrs, num_experts,
    num_bytes, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
):
    # program (pair, block of BLOCK bytes of one projection of the pair's expert)
    pair = tl.program_id(0)
    expert = tl.load(expert_ids + pair)
    is_valid, safe, _, _, _ = expert_pointers(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs)
    # the first pair of the expert in its window copies it (a later window may copy it again: same bytes)
    positions = (pair // WINDOW) * WINDOW + tl.arange(0, WINDOW)
    ids = tl.load(expert_ids + positions, mask=positions < num_pairs, other=-1)
    first = tl.min(tl.where(ids == expert, positions, num_pairs), axis=0)
    wanted = is_valid & (first == pair) & (tl.load(flags + safe) != 0)
    size = tl.where(wanted, num_bytes, 0)
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src = tl.multiple_of(tl.load(src_ptrs + safe).to(tl.pointer_type(tl.uint8)), 16)
    dst = tl.multiple_of(tl.load(dst_ptrs + safe).to(tl.pointer_type(tl.uint8)), 16)
    data = tl.load(src + offsets, mask=offsets < size, other=0)
    tl.store(dst + offsets, data, mask=offsets < size)


def fill_experts(expert_ids: torch.Tensor, tables: ExpertTables, fill: Fill) -> None:
    """Copy every selected expert whose fill flag is set from `fill.host` to `tables` (three launches, one
    per projection). expert_ids `[pairs]`; ids out of range or -1 are skipped."""
    num_pairs, device = expert_ids.shape[0], tables.device
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    fill.check(tables)
    if num_pairs == 0:
        return
    window = window_for(num_pairs)
    parts = ((fill.host.gate_ptrs, tables.gate_ptrs, tables.ff * tables.gate_row_bytes),
             (fill.host.up_ptrs, tables.up_ptrs, tables.ff * tables.up_row_bytes),
             (fill.host.down_ptrs, tables.down_ptrs, tables.hidden * tables.down_row_bytes))
    for src_ptrs, dst_ptrs, num_bytes in parts:
        _fill_kernel[(num_pairs, triton.cdiv(num_bytes, COPY_BLOCK))](
            fill.flags, src_ptrs, dst_ptrs, expert_ids, num_pairs,
            tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs, tables.num_experts,
            num_bytes, BLOCK=COPY_BLOCK, WINDOW=window,
        )


@triton.jit
def _gather_kernel(sources, rows, dst, num_experts, expert_bytes, BLOCK: tl.constexpr):
    # program p copies blocks p, p + P, ... of the experts' bytes laid end to end (P programs): a few programs, each
    # with BLOCK bytes of 16-byte loads in flight, leave the multiprocessors to the kernels that run beside them
    blocks_each = tl.cdiv(expert_bytes, BLOCK)
    offsets = tl.arange(0, BLOCK)
    for block in range(tl.program_id(0), num_experts * blocks_each, tl.num_programs(0)):
        expert = block // blocks_each
        o = (block % blocks_each).to(tl.int64) * BLOCK + offsets
        src = tl.multiple_of(tl.load(sources + expert).to(tl.pointer_type(tl.uint8)), 16)
        data = tl.load(src + o, mask=o < expert_bytes, other=0)
        tl.store(dst + tl.load(rows + expert) * expert_bytes + o, data, mask=o < expert_bytes)


GATHER_BLOCK = 16384  # bytes a program has in flight: 8 loads of 16 bytes a thread of 4 warps


def gather_experts(sources: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, programs: int = 0) -> None:
    """dst[rows[i]] = the bytes of one expert's matrix at address sources[i], for every i: one launch, whatever the
    sources (VRAM slots, pinned host memory read in place); dst's other rows are left as they are. dst: uint8
    `[n, ...]`, contiguous; sources, rows: int64 `[m]` on dst's device, sources 16-byte aligned addresses, rows in
    0..n-1. programs: 0 = one per multiprocessor."""
    count = sources.shape[0] if sources.dim() == 1 else -1
    check_vector("sources", sources, count, (torch.int64,), dst.device)
    check_vector("rows", rows, count, (torch.int64,), dst.device)
    expert_bytes = dst[0].numel() if dst.shape[0] else 0
    if dst.dtype != torch.uint8 or not dst.is_contiguous() or dst.data_ptr() % 16 or expert_bytes % 16:
        raise ValueError(f"dst: expected contiguous 16-byte aligned uint8 rows of a multiple of 16 bytes, got "
                         f"{dst.dtype} {tuple(dst.shape)}")
    if count == 0:
        return
    if not programs:
        programs = torch.cuda.get_device_properties(dst.device).multi_processor_count if dst.is_cuda else 4
    _gather_kernel[(min(programs, count * triton.cdiv(expert_bytes, GATHER_BLOCK)),)](
        sources, rows, dst, count, expert_bytes, BLOCK=GATHER_BLOCK, num_warps=4)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _spin(wait_ns):
    start = _now_ns()
    now = start
    while now - start < wait_ns:
        now = _now_ns()


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "ns_each"])  # one compile per BLOCK
def _hold_fills_kernel(expert_ids, flags, num_pairs, num_experts, ns_each, BLOCK: tl.constexpr):
    p = tl.arange(0, BLOCK)
    ids = tl.load(expert_ids + p, mask=p < num_pairs, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    flagged = valid & (tl.load(flags + tl.where(valid, ids, 0), mask=valid, other=0) != 0)
    earlier = (ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None])  # the expert's first pair counts
    first = tl.sum(earlier.to(tl.int32), axis=1) == 0
    _spin(tl.sum((flagged & first).to(tl.int64), axis=0) * ns_each)


@triton.jit(do_not_specialize=["wait_ns"])
def _hold_kernel(wait_ns):
    _spin(wait_ns)


def hold_fills(expert_ids: torch.Tensor, flags: torch.Tensor, ns_each: int) -> None:
    """Keep the current stream busy `ns_each` nanoseconds for each distinct expert of `expert_ids` `[pairs]`
    whose fill flag (`Fill.flags`) is set: after `assign_experts`, before the expert kernels copy them."""
    num_pairs = expert_ids.shape[0]
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, flags.device)
    check_vector("fill flags", flags, flags.shape[0], (torch.int8,), flags.device)
    if num_pairs and ns_each > 0:
        _hold_fills_kernel[(1,)](expert_ids, flags, num_pairs, flags.shape[0], ns_each,
                                 BLOCK=triton.next_power_of_2(num_pairs))


def hold(ns: int, device: torch.device) -> None:
    """Keep the current stream of `device` busy for `ns` nanoseconds."""
    if ns > 0:
        with torch.cuda.device(device):
            _hold_kernel[(1,)](ns)
