"""Activations in the order and scale the expert kernels read them, plus their sums per 16 columns."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, check_rows
from ops.triton.qdot import GROUP, has_kernel, read_place
from ops.triton.tables import QType


@triton.jit
def _prepare_kernel(x, x_stride, out, out_stride, sums, sums_stride, cols,
                    FMT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # program (row, block of BLOCK columns)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_cols = col < cols
    v = tl.load(x + row * x_stride + col, mask=in_cols, other=0.0).to(tl.float32)
    place, factor = read_place(col, FMT)
    tl.store(out + row * out_stride + place, v * factor, mask=in_cols)
    group = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    total = tl.sum(tl.reshape(v, [BLOCK // GROUP, GROUP]), axis=1)
    tl.store(sums + row * sums_stride + group, total, mask=group < cols // GROUP)


def launch_prepare(x: torch.Tensor, qtype: QType | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[rows, cols]` (float) -> (float32 `[rows, cols]` in the read order of the kernel of `qtype`,
    each value times 2**-e for its code's bit position e; float32 sums of x per 16 columns
    (`qdot.GROUP`) `[rows, cols // 16]`). None or a format without a kernel: natural order, factor 1."""
    rows, cols = x.shape
    check_rows("x", x, (rows, cols), FLOAT_DTYPES, x.device)
    if cols % GROUP:
        raise ValueError(f"columns must be a multiple of {GROUP}, got {cols}")
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    sums = torch.empty((rows, cols // GROUP), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, sums
    fmt = int(qtype) if qtype is not None and has_kernel(qtype) else -1
    block = min(1024, triton.next_power_of_2(cols))
    _prepare_kernel[(rows, triton.cdiv(cols, block))](
        x, x.stride(0), out, out.stride(0), sums, sums.stride(0), cols, FMT=fmt, BLOCK=block, GROUP=GROUP)
    return out, sums
