"""Dense projections read as Q8_0 on the GPU: y = x W^T (+ b), W a `ops.qweight.Q8Weight` (int8 codes `[N, K]`, a
scale per 32). A program multiplies `BM` rows of x by `BN` rows of W on the tensor cores, each weight tile
dequantized in registers (d * q rounded to bf16: the values of the bf16 copy it replaces), float32 accumulation.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.qweight import Q8Weight
from ops.triton.checks import check_device, check_rows, interpreting
from ops.triton.moe_gemm import _bf16, _mma


@triton.jit
def _q8_tile(codes, scales, n, nmask, k, K, BK: tl.constexpr):
    """Weights [k, k + BK) of rows n as float32 `[BN, BK]`: d * q, exactly. The code's byte b (q + 128 = b ^ 0x80)
    goes into mantissa bits 8-15 of 1.0, f = 1 + (q + 128) / 2**15, and w = 2**15 d f - (2**15 + 128) d is one FMA:
    its product exact, its constant exact (d is an fp16) and so its one rounding, the value d * q being a float32."""
    cols = k + tl.arange(0, BK)
    b = tl.load(codes + n.to(tl.int64)[:, None] * K + cols[None, :], mask=nmask[:, None], other=0)
    d = tl.load(scales + n.to(tl.int64)[:, None] * (K // 32) + (k // 32 + tl.arange(0, BK // 32))[None, :],
                mask=nmask[:, None], other=0.0).to(tl.float32)
    f = (((b.to(tl.int32) & 0xFF) << 8) ^ 0x3F808000).to(tl.float32, bitcast=True)
    w = tl.reshape(f, [b.shape[0], BK // 32, 32]) * (32768.0 * d)[:, :, None] - (32896.0 * d)[:, :, None]
    return tl.reshape(w, [b.shape[0], BK])


@triton.jit
def _q8_linear_kernel(x, x_stride, codes, scales, bias, y, y_stride, M, N, K, BIAS: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    # program (BN rows of W, BM rows of x)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    nmask, mmask = n < N, m < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    a_ptrs = x + m.to(tl.int64)[:, None] * x_stride + tl.arange(0, BK)[None, :]
    for k in range(0, K, BK):
        a = tl.load(a_ptrs + k, mask=mmask[:, None], other=0.0).to(tl.bfloat16)
        acc = _mma(a, _bf16(_q8_tile(codes, scales, n, nmask, k, K, BK), INTERPRET), acc, INTERPRET)
    if BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = y + m.to(tl.int64)[:, None] * y_stride + n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def block_shape(num_rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BM, BN, BK): x's rows a program (16 at least, tl.dot's least), W's rows (fewer where x has few rows, so that
    a decode step's few rows still spread a matrix over many programs), columns a step (a divisor of K)."""
    bm = min(max(16, triton.next_power_of_2(num_rows)), 64)
    bn = 32 if num_rows <= 16 else 64
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    return bm, bn, bk


def q8_linear(x: torch.Tensor, w: Q8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., K]` times W^T (+ bias) -> `[..., N]` in x's dtype; x and W on one CUDA device (or under the
    interpreter)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}], got {tuple(x.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    check_rows("x", rows, (rows.shape[0], k), (torch.float32, torch.bfloat16, torch.float16), w.device)
    check_device("scales", w.scales, w.device)
    if bias is not None:
        check_device("bias", bias, w.device)
    y = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        bm, bn, bk = block_shape(rows.shape[0], n, k)
        _q8_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(rows.shape[0], bm))](
            rows, rows.stride(0), w.codes, w.scales, bias if bias is not None else w.scales, y, y.stride(0),
            rows.shape[0], n, k, BIAS=bias is not None, BM=bm, BN=bn, BK=bk, INTERPRET=interpreting(),
            num_warps=4)
    return y.view(*x.shape[:-1], n)
