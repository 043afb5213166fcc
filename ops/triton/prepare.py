"""Activations in the order and scale the expert kernels read them, plus their sums per 16 columns.

A format of `qdot.INT8_TYPES` reads x as two int8 planes instead, in x's float32 row of `cols` values (4 * cols
bytes): int8 plane 0 `[cols]`, int8 plane 1 `[cols]`, float32 d `[cols // 32]`, with x ~= d * (q0 + q1 / 256) per
block of 32 (q0 = x / d rounded, d = max |x| / 127; q1 the rest on a 256 times finer grid, both in [-127, 127]); the
sums per 16 are then those of the planes' values, so that a weight's code and offset terms meet the same x."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, check_rows
from ops.triton.qdot import (
    GROUP,
    MXFP4,
    MXFP4_INT8,
    PLANE,
    Q4_0,
    Q4_K,
    Q4K_INT8,
    Q5_K,
    Q5K_INT8,
    Q8_0,
    Q40_INT8,
    Q80_INT8,
    has_kernel,
    mxfp4_place,
    read_place,
    reads_int8,
)
from ops.triton.tables import QType


@triton.jit
def _rounded(v):
    """v rounded to the nearest integer (half to even; |v| < 2**22)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _planes(v, col, in_cols, out, cols, block, BLOCK: tl.constexpr, MXFP4_ORDER: tl.constexpr):
    """Stores v `[BLOCK]` (columns `col` of a row) as int8 planes and d per 32 into the row at float32 pointer `out`
    (the module's layout; MXFP4_ORDER: each block's columns in `qdot.mxfp4_place`'s order); returns the planes'
    values d * (q0 + q1 / 256)."""
    blocks = tl.reshape(v, [BLOCK // 32, 32])
    amax = tl.max(tl.abs(blocks), axis=1)
    inverse = tl.where(amax > 0, 127.0 / amax, 0.0)[:, None]
    d = amax * (1.0 / 127.0)
    q0 = tl.minimum(tl.maximum(_rounded(blocks * inverse), -127.0), 127.0)
    q1 = tl.minimum(tl.maximum(_rounded((blocks - d[:, None] * q0) * (inverse * PLANE)), -127.0), 127.0)
    codes = out.to(tl.pointer_type(tl.int8), bitcast=True) + \
        tl.reshape(mxfp4_place(col) if MXFP4_ORDER else col, [BLOCK // 32, 32])
    mask = tl.reshape(in_cols, [BLOCK // 32, 32])
    tl.store(codes, q0.to(tl.int8), mask=mask)
    tl.store(codes + cols, q1.to(tl.int8), mask=mask)
    index = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(out + cols // 2 + index, d, mask=index < cols // 32)
    return tl.reshape(d[:, None] * (q0 + q1 * (1.0 / PLANE)), [BLOCK])


@triton.jit
def prepare_block(x, x_stride, out, out_stride, sums, sums_stride, cols, row, block,
                  FMT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Columns block * BLOCK .. of x's row `row`: in the read order and scale of FMT (or as int8 planes), and their
    sums per GROUP."""
    row = row.to(tl.int64)
    col = block * BLOCK + tl.arange(0, BLOCK)
    in_cols = col < cols
    v = tl.load(x + row * x_stride + col, mask=in_cols, other=0.0).to(tl.float32)
    if (FMT == Q4_K and Q4K_INT8) or (FMT == Q5_K and Q5K_INT8) or (FMT == Q8_0 and Q80_INT8) or \
            (FMT == Q4_0 and Q40_INT8) or (FMT == MXFP4 and MXFP4_INT8):  # int8 planes
        v = _planes(v, col, in_cols, out + row * out_stride, cols, block, BLOCK, FMT == MXFP4)
    else:
        place, factor = read_place(col, FMT)
        tl.store(out + row * out_stride + place, v * factor, mask=in_cols)
    group = block * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    total = tl.sum(tl.reshape(v, [BLOCK // GROUP, GROUP]), axis=1)
    tl.store(sums + row * sums_stride + group, total, mask=group < cols // GROUP)


@triton.jit
def _prepare_kernel(x, x_stride, out, out_stride, sums, sums_stride, cols,
                    FMT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # program (row, block of BLOCK columns)
    prepare_block(x, x_stride, out, out_stride, sums, sums_stride, cols, tl.program_id(0), tl.program_id(1),
                  FMT, BLOCK, GROUP)


@dataclass(frozen=True)
class Prepared:
    """x prepared for one expert format (`launch_prepare`): `x` float32 `[rows, cols]` in the kernel's read order
    and scale of `qtype`, `sums` float32 `[rows, cols // 16]`. Kernels that prepare x beside their own work
    (`ops.triton.cache_step`) launch `blocks` programs a row of `block` columns each, in format code `fmt`."""

    x: torch.Tensor
    sums: torch.Tensor
    qtype: QType | None

    @classmethod
    def empty(cls, x: torch.Tensor, qtype: QType | None) -> Prepared:
        rows, cols = x.shape
        check_rows("x", x, (rows, cols), FLOAT_DTYPES, x.device)
        if cols % GROUP:
            raise ValueError(f"columns must be a multiple of {GROUP}, got {cols}")
        return cls(torch.empty((rows, cols), dtype=torch.float32, device=x.device),
                   torch.empty((rows, cols // GROUP), dtype=torch.float32, device=x.device), qtype)

    @property
    def fmt(self) -> int:
        """The format code the kernels read (-1: natural order, factor 1)."""
        return int(self.qtype) if self.qtype is not None and has_kernel(self.qtype) else -1

    @property
    def block(self) -> int:
        """Columns a program prepares."""
        return min(1024, triton.next_power_of_2(self.x.shape[1]))

    @property
    def blocks(self) -> int:
        """Programs a row: column blocks."""
        return triton.cdiv(self.x.shape[1], self.block)


def launch_prepare(x: torch.Tensor, qtype: QType | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[rows, cols]` (float) -> (float32 `[rows, cols]` in the read order of the kernel of `qtype`,
    each value times 2**-e for its code's bit position e, or the int8 planes of the module's layout; float32 sums of
    x per 16 columns (`qdot.GROUP`) `[rows, cols // 16]`). None or a format without a kernel: natural order,
    factor 1."""
    p = Prepared.empty(x, qtype)
    if x.shape[0]:
        _prepare_kernel[(x.shape[0], p.blocks)](x, x.stride(0), p.x, p.x.stride(0), p.sums, p.sums.stride(0),
                                                x.shape[1], FMT=p.fmt, BLOCK=p.block, GROUP=GROUP)
    return p.x, p.sums


def written_bytes(x: torch.Tensor, qtype: QType | None) -> torch.Tensor:
    """Rows prepared for `qtype` (`launch_prepare`'s float32 `[rows, cols]`) as the bytes the preparation writes and
    the kernels read: an int8 format's two planes and its d per 32 (the row's other bytes are never written), else
    the whole row."""
    raw = x.view(torch.uint8)
    if qtype is None or not reads_int8(qtype):
        return raw
    cols = x.shape[1]
    return torch.cat([raw[:, :2 * cols], x[:, cols // 2:cols // 2 + cols // 32].view(torch.uint8)], dim=1)
