"""Dense projections read as Q8_0 on the GPU: y = x W^T (+ b), W a `ops.qweight.Q8Weight` (int8 codes `[N, K]`, a
scale per 32). A program multiplies `BM` rows of x by `BN` rows of W on the tensor cores, each weight tile
dequantized in registers (d * q rounded to bf16: the values of the bf16 copy it replaces), float32 accumulation.
Where K is split over programs (a decode step's few rows), each part is stored in float32 and the tile's last part to
arrive (an atomic count) adds them in part order and writes y: one launch, deterministic, no sum after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.qweight import Q8Weight
from ops.triton.checks import FLOAT_DTYPES, check_device, check_rows, interpreting
from ops.triton.moe_gemm import _bf16, _mma, _mma_t


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
def _q8_linear_kernel(x, x_stride, codes, scales, bias, y, y_stride, work, arrived, M, N, K, k_split, splits,
                      BIAS: tl.constexpr, W_LEFT: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    # program (BN rows of W, BM rows of x, a k_split-column part of K): y's tile, or with SPLIT its part of it
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    part = tl.program_id(2)
    nmask, mmask = n < N, m < M
    a_ptrs = x + m.to(tl.int64)[:, None] * x_stride + tl.arange(0, BK)[None, :]
    if W_LEFT:  # the weights as the left operand (Hopper's wgmma from registers): warps split W's rows
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        for k in range(part * k_split, (part + 1) * k_split, BK):
            a = tl.load(a_ptrs + k, mask=mmask[:, None], other=0.0).to(tl.bfloat16)
            acc_t = _mma_t(_bf16(_q8_tile(codes, scales, n, nmask, k, K, BK), INTERPRET), a, acc_t, INTERPRET)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(part * k_split, (part + 1) * k_split, BK):
            a = tl.load(a_ptrs + k, mask=mmask[:, None], other=0.0).to(tl.bfloat16)
            acc = _mma(a, _bf16(_q8_tile(codes, scales, n, nmask, k, K, BK), INTERPRET), acc, INTERPRET)
    tile = mmask[:, None] & nmask[None, :]
    if SPLIT:  # the parts in float32; the tile's last part to arrive sums them in part order and writes y
        parts = work + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(parts + part * M * N, acc, mask=tile)
        tl.debug_barrier()  # every thread's part is stored before the program arrives
        counter = arrived + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
        if last:
            acc = tl.load(parts, mask=tile, other=0.0, cache_modifier=".cg")
            for p in range(1, splits):
                acc += tl.load(parts + p * M * N, mask=tile, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)  # for the next product (a graph replays the same counters)
    else:
        last = True
    if last:
        if BIAS:
            acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y + m.to(tl.int64)[:, None] * y_stride + n[None, :], acc.to(y.dtype.element_ty), mask=tile)


@dataclass(frozen=True)
class Q8LinearConfig:
    """x's rows a program (16 at least, tl.dot's least), W's rows, columns a step (a divisor of K), parts of K
    (each a program's, added by the tile's last to finish), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    w_left: bool = False  # the weights as the left operand (block_n >= 64 for wgmma)


SMS = 132  # an H100/H200's multiprocessors: a decode step's matrix is spread over about two programs each


def default_config(num_rows: int, n: int, k: int) -> Q8LinearConfig:
    """Up to 16 rows (a decode step's few): 32 rows of W a program, 256 columns a step 4 steps ahead (the loads in
    flight a matrix read at the memory's rate needs); more rows: the weights as the left operand, 64 of W's rows a
    program, so that no warp dequantizes another's weights. K split where W has too few rows to fill the machine."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    small = block_m == 16
    block_n = 32 if small else 64
    bk = next(b for b in ((256, 128, 64, 32) if small else (128, 64, 32)) if k % b == 0)
    programs, splits = triton.cdiv(n, block_n) * triton.cdiv(num_rows, block_m), 1
    while num_rows <= 64 and programs * splits < 2 * SMS and k % (2 * splits * bk) == 0 and k // (2 * splits) >= 2 * bk:
        splits *= 2
    return Q8LinearConfig(block_m, block_n, bk, splits, 4, 4 if small else 3, w_left=not small)


def q8_linear(x: torch.Tensor, w: Q8Weight, bias: torch.Tensor | None = None,
              config: Q8LinearConfig | None = None) -> torch.Tensor:
    """x `[..., K]` times W^T (+ bias) -> `[..., N]` in x's dtype; x and W on one CUDA device (or under the
    interpreter). No host sync: a decode step's products are captured with it."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}], got {tuple(x.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    check_rows("x", rows, (num_rows, k), FLOAT_DTYPES, w.device)
    check_device("scales", w.scales, w.device)
    if bias is not None:
        check_device("bias", bias, w.device)
    c = config or default_config(num_rows, n, k)
    if k % (c.splits * c.block_k):
        raise ValueError(f"{c}: K {k} is not whole steps of every part")
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(num_rows, c.block_m), c.splits)
    work, arrived = y, y
    if c.splits > 1:
        work = torch.empty((c.splits, num_rows, n), dtype=torch.float32, device=x.device)
        arrived = _arrival_counters(x.device, grid[0] * grid[1])
    if num_rows:
        _q8_linear_kernel[grid](
            rows, rows.stride(0), w.codes, w.scales, bias if bias is not None else w.scales, y, y.stride(0), work,
            arrived, num_rows, n, k, k // c.splits, c.splits, BIAS=bias is not None, W_LEFT=c.w_left,
            SPLIT=c.splits > 1, BM=c.block_m, BN=c.block_n, BK=c.block_k, INTERPRET=interpreting(),
            num_warps=c.num_warps, num_stages=c.num_stages)
    return y.view(*x.shape[:-1], n)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one a tile of a split product, kept per device (each product leaves them zero).
    NOTE: products on one stream only (they share the counters), and made before a graph captures any: a warm-up
    step allocates them."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("q8_linear: a split product's counters are made outside a graph capture (warm up first)")
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters
