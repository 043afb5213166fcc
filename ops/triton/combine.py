"""Sum of the pairs' outputs per token, in pair order: deterministic, no atomics."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.cache_step import Bell
from ops.triton.bell import wait_bell
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_vector


@triton.jit
def _combine_kernel(y, y_stride, token_ids, num_pairs, out, out_stride, hidden, extra, extra_stride, bell_words,
                    bell_state, BP: tl.constexpr, BH: tl.constexpr, HAS_EXTRA: tl.constexpr, BELL: tl.constexpr):
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
    if HAS_EXTRA:  # a partial sum computed elsewhere (the CPU's share of the pairs), added last
        mask = cmask
        if BELL:  # once the CPU answered; nothing when the layer did not ring (the rows are an older layer's)
            mask = cmask & (wait_bell(bell_words, bell_state) != 0)
        acc += tl.load(extra + token.to(tl.int64) * extra_stride + cols, mask=mask, other=0.0, cache_modifier=".cv")
    tl.store(out + token.to(tl.int64) * out_stride + cols, acc.to(out.dtype.element_ty), mask=cmask)


def launch_combine(y: torch.Tensor, token_ids: torch.Tensor, out: torch.Tensor, block_pairs: int = 16,
                   block_cols: int = 256, num_warps: int = 4, extra: torch.Tensor | None = None,
                   bell: Bell | None = None) -> None:
    """out[t] = sum of y[p] over the pairs p of token t, in pair order (0 for a token with none).
    NOTE: every row of y is read whose token is in range, so skipped pairs must hold 0 (the down
    launch writes them). y float32 `[pairs, hidden]`; token_ids `[pairs]`; out `[tokens, hidden]`, float32
    or a 16-bit float (the float32 sum rounded once). `extra`: float32 rows `[>= tokens, hidden]` added to each
    token's sum (may be pinned host memory, read in place); with `bell`, once the CPU answered the layer's ring,
    and only when the layer rang (`ops.triton.bell.wait_bell`)."""
    num_pairs, hidden, device = y.shape[0], y.shape[1], y.device
    check_rows("y", y, (num_pairs, hidden), (torch.float32,), device)
    check_vector("token_ids", token_ids, num_pairs, INDEX_DTYPES, device)
    check_rows("out", out, (out.shape[0], hidden), FLOAT_DTYPES, device)
    if extra is not None and (extra.dtype != torch.float32 or extra.dim() != 2 or extra.shape[0] < out.shape[0]
                              or extra.shape[1] != hidden or extra.stride(1) != 1):
        raise ValueError(f"extra: expected float32 [>= {out.shape[0]}, {hidden}], got {extra.dtype} "
                         f"{tuple(extra.shape)}")
    if out.shape[0] == 0:
        return
    grid = (out.shape[0], triton.cdiv(hidden, block_cols))
    _combine_kernel[grid](y, y.stride(0), token_ids, num_pairs, out, out.stride(0), hidden,
                          extra if extra is not None else y, extra.stride(0) if extra is not None else 0,
                          bell.words if bell is not None else y, bell.state if bell is not None else y,
                          BP=block_pairs, BH=block_cols, HAS_EXTRA=extra is not None, BELL=bell is not None,
                          num_warps=num_warps)
