"""Activations in the order and scale the expert kernels read them, plus their sums per 16 columns."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, check_rows
from ops.triton.qdot import GROUP, has_kernel, read_place
from ops.triton.tables import QType


@triton.jit
def prepare_block(x, x_stride, out, out_stride, sums, sums_stride, cols, row, block,
                  FMT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Columns block * BLOCK .. of x's row `row`: in the read order and scale of FMT, and their sums per GROUP."""
    row = row.to(tl.int64)
    col = block * BLOCK + tl.arange(0, BLOCK)
    in_cols = col < cols
    v = tl.load(x + row * x_stride + col, mask=in_cols, other=0.0).to(tl.float32)
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
    each value times 2**-e for its code's bit position e; float32 sums of x per 16 columns
    (`qdot.GROUP`) `[rows, cols // 16]`). None or a format without a kernel: natural order, factor 1."""
    p = Prepared.empty(x, qtype)
    if x.shape[0]:
        _prepare_kernel[(x.shape[0], p.blocks)](x, x.stride(0), p.x, p.x.stride(0), p.sums, p.sums.stride(0),
                                                x.shape[1], FMT=p.fmt, BLOCK=p.block, GROUP=GROUP)
    return p.x, p.sums
