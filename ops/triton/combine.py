"""Sum of the pairs' outputs per token, in pair order: deterministic, no atomics."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_vector


@triton.jit
def _combine_kernel(y, y_stride, token_ids, num_pairs, out, out_stride, hidden,
                    BP: tl.constexpr, BH: tl.constexpr):
    # program (token, block of BH columns); reads only the rows of its token's pairs
    token = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cmask = cols < hidden
    acc = tl.zeros([BH], tl.float32)
    for start in range(0, num_pairs, BP):
        pairs = start + tl.arange(0, BP)
        is_mine = tl.load(token_ids + pairs, mask=pairs < num_pairs, other=-1) == token
        rows = y + pairs.to(tl.int64)[:, None] * y_stride + cols[None, :]
        acc += tl.sum(tl.load(rows, mask=is_mine[:, None] & cmask[None, :], other=0.0), axis=0)
    tl.store(out + token.to(tl.int64) * out_stride + cols, acc.to(out.dtype.element_ty), mask=cmask)


def launch_combine(y: torch.Tensor, token_ids: torch.Tensor, out: torch.Tensor, block_pairs: int = 16,
                   block_cols: int = 256, num_warps: int = 4) -> None:
    """out[t] = sum of y[p] over the pairs p of token t, in pair order (0 for a token with none).
    NOTE: every row of y is read whose token is in range, so skipped pairs must hold 0 (the down
    launch writes them). y float32 `[pairs, hidden]`; token_ids `[pairs]`; out `[tokens, hidden]`, float32
    or a 16-bit float (the float32 sum rounded once)."""
    num_pairs, hidden, device = y.shape[0], y.shape[1], y.device
    check_rows("y", y, (num_pairs, hidden), (torch.float32,), device)
    check_vector("token_ids", token_ids, num_pairs, INDEX_DTYPES, device)
    check_rows("out", out, (out.shape[0], hidden), FLOAT_DTYPES, device)
    if out.shape[0] == 0:
        return
    grid = (out.shape[0], triton.cdiv(hidden, block_cols))
    _combine_kernel[grid](y, y.stride(0), token_ids, num_pairs, out, out.stride(0), hidden,
                          BP=block_pairs, BH=block_cols, num_warps=num_warps)
