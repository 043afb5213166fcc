"""Prefill's routed experts on tensor cores straight from the GGUF bytes (llama.cpp's MMQ idea, in Triton).

The (token, expert) pairs are sorted by expert (`order`, per-expert `ends`); a tile is BLOCK_M consecutive
pairs of ONE expert. A program computes one tile x BLOCK_N output rows: it loops over K, loads the expert's
quantized weights for (BLOCK_N rows, BLOCK_K cols) from the expert's raw bytes, dequantizes them in registers to
bf16 and multiplies them with the bf16 activations on the tensor cores (`tl.dot`, float32 accumulation).
Nothing dequantized ever reaches memory: the grouped GEMM of `ops.grouped_gemm` writes and re-reads ~1.2 GB of
bf16 per Qwen3-30B-A3B layer at pp512, these kernels read the ~0.34 GB of quantized bytes once per tile.

Three kernels per layer:
1. gate and up together, with the expert's activation and biases (`ops.expert_math.ExpertMath`): h `[pairs,
   ff]` bf16, in sorted order;
2. down, with the down bias and the pair's routing weight: y `[pairs, hidden]` float32, in pair order;
3. each token's sum of its pairs' rows, in pair order (deterministic, no atomics).

A weight tile is `[BLOCK_N, BLOCK_K // 16, 16]`: groups of 16 consecutive weights, the finest unit of a
scale in every format here (Q6_K's sub-blocks), so each group finds its own block and scales. BLOCK_K is any
multiple of 16 dividing K: a K-quant super-block may span several K steps, its scales are read per group.

An expert's bytes are found through its address (`ops.triton.tables.ExpertTables`, as the decode kernels find
theirs), so one launch reads experts wherever they are: a bank's rows, or a prompt's staged layer whose cached
experts stay in their cache slots (`engine.expert_cache.staging`).

The tile schedule needs no host sync: the grid has an upper bound of tiles, `cdiv(pairs, BLOCK_M) +
experts`; a program finds its expert from the per-expert tile counts (computed on the device) and exits
if it has none. Formats: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 (`has_kernel`: those of the decode kernels,
`ops.triton.qdot`), any mix over gate, up and down; every `ExpertMath`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.bank import ExpertWeights
from ops.quants import QType
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_rows, check_vector, interpreting
from ops.triton.dequant import _byte, _f16_at, _float, _scale_min_k4
from ops.triton.experts import tables_from_bank
from ops.triton.gate_up import ACTIVATIONS, _activation
from ops.triton.qdot import (
    KERNEL_TYPES,
    MXFP4,
    MXFP4_PLANAR,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    _e2m1,
    _e8m0_scale,
    has_kernel,
    kernel_format,
    planar_offsets,
)
from ops.triton.tables import ExpertTables

GROUP = 16  # weights sharing one scale, in every format of KERNEL_TYPES
SUM_COLS = 256  # columns per program of the per-token sum
# Q4_K by whole super-blocks (`_k4_super`), 0: by groups of 16 as the other formats (H100, one Q4_K layer at 512 /
# 2048 tokens: 0.99 / 1.89 ms against 2.26 / 5.63)
WHOLE_SUPER_BLOCKS = os.environ.get("MOECACHE_PREFILL_SUPER", "1") != "0"


def covers(bank: ExpertWeights) -> bool:
    """The bank's three formats have tile kernels (its math always does)."""
    return all(has_kernel(t) for t in (bank.gate_type, bank.up_type, bank.down_type))


@dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int | None = None  # pairs per tile (>= 16); None: from the mean pairs per expert
    block_n: int = 64  # output rows per program (halved until it divides the rows)
    block_k: int = 64  # weights per K step (halved until it divides K; a multiple of 16)
    num_warps: int = 4  # H200, Qwen3-30B-A3B's Q4_K_M layer: 2.21 ms at 512 tokens where 8 warps took 3.28
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            block = getattr(self, name)
            if block is not None and (block < 16 or block & (block - 1)):
                raise ValueError(f"{name}: expected a power of 2 >= 16 (tl.dot's least), got {block}")

    def tile_m(self, num_pairs: int, num_experts: int) -> int:
        if self.block_m is not None:
            return self.block_m
        mean = num_pairs / max(num_experts, 1)
        return next((m for m in (16, 32, 64) if mean <= m), 128)


# --- weight tiles: `base` an expert's matrix, `rows` int32 byte offsets of its rows [BN, 1, 1], groups g
# [1, G, 1], c [1, 1, 16]; int32 offsets keep the tile's addresses out of 64-bit registers


@triton.jit
def _affine_k(base, rows, g, c, FIFTH: tl.constexpr):
    """Q4_K / Q5_K (super-blocks of 256, sub-blocks of 32): weight 32s + c' of sub-block s is nibble s % 2 of
    qs byte 32 (s // 2) + c'; Q5_K (FIFTH) adds bit s of qh byte c' as bit 4. w = (d * sc) * q - dmin * m."""
    blk = rows + (g // 16) * (144 + 32 * FIFTH)
    sub, cc = (g % 16) // 2, 16 * (g % 2) + c
    sc, mn = _scale_min_k4(base + blk + 4, sub)
    q = (_byte(base + (blk + 16 + 32 * FIFTH + 32 * (sub // 2) + cc)) >> 4 * (sub % 2)) & 15
    if FIFTH:
        q = q | (((_byte(base + (blk + 16 + cc)) >> sub) & 1) << 4)
    return (_f16_at(base + blk) * _float(sc, 0.0)) * _float(q, 0.0) - _f16_at(base + blk + 2) * _float(mn, 0.0)


@triton.jit
def _q6_k(base, rows, g, c):
    """Q6_K: group j of 16 (half j // 8, run a = (j % 8) // 2) is nibble a // 2 of ql bytes 64 half + 32 (a % 2)
    + c' with bits 2a of qh bytes 128 + 32 half + c' above it; int8 scale j. w = (d * sc) * (q - 32)."""
    blk = rows + (g // 16) * 210
    j = g % 16
    half, a, cc = j // 8, (j % 8) // 2, 16 * (j % 2) + c
    low = (_byte(base + (blk + 64 * half + 32 * (a % 2) + cc)) >> 4 * (a // 2)) & 15
    high = (_byte(base + (blk + 128 + 32 * half + cc)) >> 2 * a) & 3
    sc = _byte(base + blk + 192 + j) ^ 0x80  # the int8 scale + 128
    return (_f16_at(base + blk + 208) * _float(sc, 128.0)) * _float(low | (high << 4), 32.0)


@triton.jit
def _q8_0(base, rows, g, c):
    """Q8_0 (blocks of 32: fp16 d, int8 q): w = d * q."""
    blk = rows + (g // 2) * 34
    return _f16_at(base + blk) * _float(_byte(base + (blk + 2 + 16 * (g % 2) + c)) ^ 0x80, 128.0)


@triton.jit
def _q4_0(base, rows, g, c):
    """Q4_0 (blocks of 32: fp16 d, 16 bytes): weight 16h + c is nibble h of byte c. w = d * (q - 8)."""
    blk = rows + (g // 2) * 18
    q = (_byte(base + (blk + 2 + c)) >> 4 * (g % 2)) & 15
    return _f16_at(base + blk) * _float(q, 8.0)


@triton.jit
def _mxfp4(base, rows, g, c):
    """MXFP4 (blocks of 32: e8m0 e, 16 bytes of e2m1 codes): weight 16h + c is nibble h of byte c.
    w = 2**(e - 128) * doubled e2m1, exact in bf16 (codes of 4 significant bits)."""
    blk = rows + (g // 2) * 17
    return _e2m1(_byte(base + (blk + 1 + c)) >> 4 * (g % 2), 0) * _e8m0_scale(_byte(base + blk))


@triton.jit
def _mxfp4_planar(base, codes, scales, g, c):
    """Planar MXFP4 (`ops.bank.to_planar`; codes, scales: the rows' byte offsets of their codes and scales): weight
    16h + c of block b is nibble h of code byte 16b + c."""
    q = _byte(base + (codes + 16 * (g // 2) + c)) >> 4 * (g % 2)
    return _e2m1(q, 0) * _e8m0_scale(_byte(base + (scales + g // 2)))


@triton.jit
def _row_offsets(n, row_bytes, cols, FMT: tl.constexpr):
    """Rows n's byte offsets `[BN, 1, 1]` where `_weight_tile` reads them: their first bytes, and for planar MXFP4
    (`ops.bank.to_planar`) their codes' and their scales'."""
    if FMT == MXFP4_PLANAR:
        codes, scales = planar_offsets(n, row_bytes, cols)
    else:
        codes, scales = n * row_bytes, n * row_bytes
    return codes[:, None, None], scales[:, None, None]


@triton.jit
def _weight_tile(base, rows, scales, k, BN: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Weights [k, k + BK) of the rows -> bf16 `[BN, BK]` (rows, scales: `_row_offsets`)."""
    g = k // 16 + tl.arange(0, BK // 16)[None, :, None]
    c = tl.arange(0, 16)[None, None, :]
    if FMT == Q4_K or FMT == Q5_K:
        w = _affine_k(base, rows, g, c, FMT == Q5_K)
    elif FMT == Q6_K:
        w = _q6_k(base, rows, g, c)
    elif FMT == Q8_0:
        w = _q8_0(base, rows, g, c)
    elif FMT == MXFP4:
        w = _mxfp4(base, rows, g, c)
    elif FMT == MXFP4_PLANAR:
        w = _mxfp4_planar(base, rows, scales, g, c)
    else:
        tl.static_assert(FMT == Q4_0, "moe_gemm: no tile kernel for this format")
        w = _q4_0(base, rows, g, c)
    return _bf16(tl.reshape(w, [BN, BK]), INTERPRET)


@triton.jit
def _bf16(w, INTERPRET: tl.constexpr):
    """float32 -> bf16, to nearest even. NOTE: the interpreter's cast truncates: INTERPRET rounds in integer
    ops (finite w), so that the interpreter sees the GPU's operands."""
    if INTERPRET:
        bits = w.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return w.to(tl.bfloat16)


@triton.jit
def _mma(a, w, acc, INTERPRET: tl.constexpr):
    """acc + a `[BM, BK]` @ w `[BN, BK]`^T, both bf16. NOTE: the interpreter (Triton 3.9) multiplies bf16
    operands wrongly: INTERPRET multiplies the same values widened to float32, exactly."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


# --- Q4_K by whole chunks: chunk j (64 columns) of a super-block is its qs bytes [32j, 32j + 32), the low
# nibbles sub-block 2j and the high ones 2j + 1, each in column order; scales once per row and sub-block


@triton.jit
def _k4_scales(w1, w2, w3, S: tl.constexpr):
    """The 6-bit scale and min of sub-block S (float32 `[BN]`) from a Q4_K super-block's words 1-3 (the 12 scale
    bytes b; word 0 is fp16 d | dmin << 16): S < 4: b[S] & 63, b[S + 4] & 63; else (b[S + 4] & 15) | (b[S - 4] >> 6)
    << 4, (b[S + 4] >> 4) | (b[S] >> 6) << 4. NOTE: `qdot._kquant_scales` unpacks the same fields for the decode
    kernels; through it this loop counts 7.3 instructions a weight for sm90, not 7.0 (its float conversion of the
    fields is two instructions, here one), and the timed kernel is this one."""
    shift: tl.constexpr = 8 * (S % 4)
    if S < 4:
        sc = (w1 >> shift) & 63
        mn = (w2 >> shift) & 63
    else:
        sc = ((w3 >> shift) & 15) | (((w1 >> (shift + 6)) & 3) << 4)
        mn = ((w3 >> (shift + 4)) & 15) | (((w2 >> (shift + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _mma_t(w, a, acc, INTERPRET: tl.constexpr):
    """acc `[BN, BM]` + w `[BN, BK]` @ a `[BM, BK]`^T, both bf16 (`_mma` with the weights as the left operand)."""
    if INTERPRET:
        return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(a), acc)


@triton.jit
def _k4_super(acc, a_ptrs, rmask, base, blk, INTERPRET: tl.constexpr):
    """acc `[BN, BM]` + a Q4_K super-block of the rows (blk: its byte offsets `[BN]`) times the activations `[BM,
    256]` at a_ptrs (bf16 pointers `[BM, 32]` to the super-block's first 32 columns): the weights are the left
    operand (on sm90 wgmma, its A operand in registers: no warp dequantizes another's weights)."""
    words = (base + blk).to(tl.pointer_type(tl.int32), bitcast=True)
    head, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    pairs = (base + blk[:, None] + 16).to(tl.pointer_type(tl.int16), bitcast=True) + tl.arange(0, 16)[None, :]
    d = (head & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((head >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    for j in tl.static_range(4):
        v = tl.load(pairs + 16 * j).to(tl.int32)
        sc_lo, mn_lo = _k4_scales(w1, w2, w3, 2 * j)
        sc_hi, mn_hi = _k4_scales(w1, w2, w3, 2 * j + 1)
        # a byte in mantissa bits 15-22 of 1.0: the low nibble v as the float 1 + v / 256, the high one as
        # 1 + v / 16, so that w = 256 s (1 + v / 256) - (256 s + m) is one FMA (its product exact; the constant's
        # rounding moves w by at most 2**-16 s, far under the bf16 rounding w takes next)
        t0, t1 = v << 15, v << 7  # the pair's first byte, its second
        lo = tl.reshape(tl.join(t0 & 0x78000, t1 & 0x78000), [v.shape[0], 32]) | 0x3F800000
        hi = tl.reshape(tl.join(t0 & 0x780000, t1 & 0x780000), [v.shape[0], 32]) | 0x3F800000
        lo, hi = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
        s_lo, s_hi = (256.0 * d) * sc_lo, (16.0 * d) * sc_hi
        lo = lo * s_lo[:, None] - (s_lo + dmin * mn_lo)[:, None]
        hi = hi * s_hi[:, None] - (s_hi + dmin * mn_hi)[:, None]
        a_lo = tl.load(a_ptrs + 64 * j, mask=rmask[:, None], other=0.0).to(tl.bfloat16)
        a_hi = tl.load(a_ptrs + 64 * j + 32, mask=rmask[:, None], other=0.0).to(tl.bfloat16)
        acc = _mma_t(_bf16(lo, INTERPRET), a_lo, acc, INTERPRET)
        acc = _mma_t(_bf16(hi, INTERPRET), a_hi, acc, INTERPRET)
    return acc


# --- the schedule and the kernels ----------------------------------------------------------------------


@triton.jit
def _expert_base(ptrs, e):
    """Expert e's first byte, from its table of addresses (16-byte aligned, `ExpertTables`)."""
    return tl.multiple_of(tl.load(ptrs + e).to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _tile(ends, tile_ends, num_experts, BM: tl.constexpr, E_POW2: tl.constexpr):
    """Program axis 1 -> (expert, its first sorted pair, its end): tile t is the expert's (t - its first
    tile)-th; expert >= num_experts for a program past the last tile."""
    t = tl.program_id(1)
    experts = tl.arange(0, E_POW2)
    counts = tl.load(tile_ends + experts, mask=experts < num_experts, other=2147483647)
    expert = tl.sum((counts <= t).to(tl.int32))
    e = tl.minimum(expert, num_experts - 1)
    before = e > 0
    first_tile = tl.load(tile_ends + e - 1, mask=before, other=0)
    start = tl.load(ends + e - 1, mask=before, other=0)
    return expert, start + (t - first_tile) * BM, tl.load(ends + e)


@triton.jit
def _gate_up_kernel(x, x_stride, token_ids, order, ends, tile_ends, num_experts, gate_ptrs, gate_row,
                    up_ptrs, up_row, gate_bias, up_bias, alpha, limit, h, hidden, ff,
                    GATE_FMT: tl.constexpr, UP_FMT: tl.constexpr, ACT: tl.constexpr, GATE_BIAS: tl.constexpr,
                    UP_BIAS: tl.constexpr, SUPER: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr,
                    INTERPRET: tl.constexpr):
    expert, first, end = _tile(ends, tile_ends, num_experts, BM, E_POW2)
    if expert >= num_experts:
        return
    rows = first + tl.arange(0, BM)
    rmask = rows < end
    tokens = tl.load(token_ids + tl.load(order + rows, mask=rmask, other=0), mask=rmask, other=0)
    a_ptrs = x + tokens.to(tl.int64)[:, None] * x_stride + tl.arange(0, BK)[None, :]
    n = tl.program_id(0) * BN + tl.arange(0, BN)  # rows of gate and up
    e = expert.to(tl.int64)
    g_base, u_base = _expert_base(gate_ptrs, e), _expert_base(up_ptrs, e)
    g_rows, g_scales = _row_offsets(n, gate_row, hidden, GATE_FMT)
    u_rows, u_scales = _row_offsets(n, up_row, hidden, UP_FMT)
    if SUPER:  # the weights as the left operand: accumulators `[BN, BM]`
        acc_gt = tl.zeros([BN, BM], dtype=tl.float32)
        acc_ut = tl.zeros([BN, BM], dtype=tl.float32)
        for kb in range(0, hidden // 256):
            acc_gt = _k4_super(acc_gt, a_ptrs + 256 * kb, rmask, g_base, n * gate_row + 144 * kb, INTERPRET)
            acc_ut = _k4_super(acc_ut, a_ptrs + 256 * kb, rmask, u_base, n * up_row + 144 * kb, INTERPRET)
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, hidden, BK):
            a = tl.load(a_ptrs + k, mask=rmask[:, None], other=0.0).to(tl.bfloat16)
            acc_g = _mma(a, _weight_tile(g_base, g_rows, g_scales, k, BN, BK, GATE_FMT, INTERPRET), acc_g, INTERPRET)
            acc_u = _mma(a, _weight_tile(u_base, u_rows, u_scales, k, BN, BK, UP_FMT, INTERPRET), acc_u, INTERPRET)
    if GATE_BIAS:
        acc_g += tl.load(gate_bias + e * ff + n)[None, :]
    if UP_BIAS:
        acc_u += tl.load(up_bias + e * ff + n)[None, :]
    value = _activation(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h + rows.to(tl.int64)[:, None] * ff + n[None, :], _bf16(value, INTERPRET), mask=rmask[:, None])


@triton.jit
def _down_kernel(h, order, weights, ends, tile_ends, num_experts, down_ptrs, down_row, down_bias, y,
                 hidden, ff, BIAS: tl.constexpr, DOWN_FMT: tl.constexpr, SUPER: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr, INTERPRET: tl.constexpr):
    expert, first, end = _tile(ends, tile_ends, num_experts, BM, E_POW2)
    if expert >= num_experts:
        return
    rows = first + tl.arange(0, BM)
    rmask = rows < end
    a_ptrs = h + rows.to(tl.int64)[:, None] * ff + tl.arange(0, BK)[None, :]
    n = tl.program_id(0) * BN + tl.arange(0, BN)  # rows of down: output columns
    e = expert.to(tl.int64)
    d_base = _expert_base(down_ptrs, e)
    d_rows, d_scales = _row_offsets(n, down_row, ff, DOWN_FMT)
    if SUPER:
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        for kb in range(0, ff // 256):
            acc_t = _k4_super(acc_t, a_ptrs + 256 * kb, rmask, d_base, n * down_row + 144 * kb, INTERPRET)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, ff, BK):
            a = tl.load(a_ptrs + k, mask=rmask[:, None], other=0.0)
            acc = _mma(a, _weight_tile(d_base, d_rows, d_scales, k, BN, BK, DOWN_FMT, INTERPRET), acc, INTERPRET)
    if BIAS:
        acc += tl.load(down_bias + e * hidden + n)[None, :]
    pairs = tl.load(order + rows, mask=rmask, other=0)
    acc *= tl.load(weights + pairs, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(y + pairs.to(tl.int64)[:, None] * hidden + n[None, :], acc, mask=rmask[:, None])


@triton.jit
def _sum_kernel(y, by_token, token_ends, key, num_experts, out, hidden, BH: tl.constexpr):
    # program (token, BH columns): the token's pairs in pair order (`by_token` sorts them stably)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cmask = cols < hidden
    start = tl.load(token_ends + t - 1, mask=t > 0, other=0)
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in range(start, tl.load(token_ends + t)):
        pair = tl.load(by_token + j)
        is_kept = tl.load(key + pair) < num_experts  # a skipped pair's row of y is never written
        acc += tl.load(y + pair.to(tl.int64) * hidden + cols, mask=tl.where(is_kept, cmask, False), other=0.0)
    tl.store(out + t.to(tl.int64) * hidden + cols, acc, mask=cmask)


# --- the launcher -----------------------------------------------------------------------------------------


def expert_ffn_moe_gemm(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                        experts: ExpertWeights | ExpertTables, config: MoeGemmConfig = MoeGemmConfig(),
                        pairs_per_token: int | None = None) -> torch.Tensor:
    """The signature of `ops.expert_ffn` (rows -1, or out of range, skipped) -> float32 `[tokens, hidden]`: bf16
    activations and weights, float32 accumulation, h rounded to bf16. experts: a bank (a `covers` one) on x's device,
    or the tables of its experts' addresses there (each expert wherever it is); no host sync. pairs_per_token: the
    pairs come token by token, this many a token (`engine.moe.flatten_pairs`), so none is sorted by token (a prompt's
    host layers launch eagerly: launches fewer)."""
    tables = experts if isinstance(experts, ExpertTables) else tables_from_bank(_on(experts, x.device), x.device)
    num_pairs, device = token_ids.shape[0], x.device
    _check(x, token_ids, bank_rows, weights, tables)
    if num_pairs == 0 or x.shape[0] == 0:
        return torch.zeros((x.shape[0], tables.hidden), dtype=torch.float32, device=device)
    if pairs_per_token is not None and num_pairs != x.shape[0] * pairs_per_token:
        raise ValueError(f"{num_pairs} pairs are not {pairs_per_token} for each of {x.shape[0]} tokens")
    out = torch.empty((x.shape[0], tables.hidden), dtype=torch.float32, device=device)  # every row summed into
    block_m = config.tile_m(num_pairs, tables.num_experts)
    key, order, ends, tile_ends = _schedule(bank_rows, tables.num_experts, block_m)
    grid_tiles = triton.cdiv(num_pairs, block_m) + tables.num_experts
    h = torch.empty((num_pairs, tables.ff), dtype=torch.bfloat16, device=device)
    _launch_gate_up(x.to(torch.bfloat16), token_ids, order, ends, tile_ends, tables, h, block_m, grid_tiles, config)
    y = torch.empty((num_pairs, tables.hidden), dtype=torch.float32, device=device)
    _launch_down(h, order, weights, ends, tile_ends, tables, y, block_m, grid_tiles, config)
    if pairs_per_token is None:
        by_token = torch.argsort(token_ids, stable=True).int()
        tokens = torch.arange(x.shape[0], dtype=token_ids.dtype, device=device)
        token_ends = torch.searchsorted(token_ids[by_token], tokens, right=True, out_int32=True)
    else:
        by_token = torch.arange(num_pairs, dtype=torch.int32, device=device)
        token_ends = torch.arange(pairs_per_token, num_pairs + 1, pairs_per_token, dtype=torch.int32, device=device)
    _sum_kernel[(x.shape[0], triton.cdiv(tables.hidden, SUM_COLS))](
        y, by_token, token_ends, key, tables.num_experts, out, tables.hidden, BH=SUM_COLS)
    return out


def _on(bank: ExpertWeights, device: torch.device) -> ExpertWeights:
    """The bank, refused unless it lives on `device` (the kernels read it there)."""
    for name in ("gate", "up", "down"):
        check_device(name, getattr(bank, name), device)
    return bank


def _schedule(bank_rows: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """key (the pair's expert, num_experts if skipped), order (pairs sorted by key), ends (of each expert's
    sorted pairs) and tile_ends (cumulative tiles of BLOCK_M): int32, on the device, no host sync."""
    # NOTE: a prompt's host layers launch this eagerly: int32 where torch can, so that no launch only converts
    is_kept = (bank_rows >= 0) & (bank_rows < num_experts)
    key = torch.where(is_kept, bank_rows, num_experts).to(torch.int32)
    order = torch.argsort(key, stable=True)
    experts = torch.arange(num_experts, dtype=torch.int32, device=key.device)
    ends = torch.searchsorted(key[order], experts, right=True, out_int32=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0, dtype=torch.int32)
    return key, order.int(), ends, tile_ends


def _launch_gate_up(x: torch.Tensor, token_ids: torch.Tensor, order: torch.Tensor, ends: torch.Tensor,
                    tile_ends: torch.Tensor, t: ExpertTables, h: torch.Tensor, block_m: int, grid_tiles: int,
                    config: MoeGemmConfig) -> None:
    math = t.math
    biases = _biases(t)
    whole = whole_super_blocks(t.gate_type, t.hidden) and whole_super_blocks(t.up_type, t.hidden)
    block_n, block_k = _fit(config.block_n, t.ff), 32 if whole else _fit(config.block_k, t.hidden)
    _gate_up_kernel[(t.ff // block_n, grid_tiles)](
        x, x.stride(0), token_ids, order, ends, tile_ends, t.num_experts, t.gate_ptrs, t.gate_row_bytes,
        t.up_ptrs, t.up_row_bytes, biases[0], biases[1],
        math.alpha, math.limit, h, t.hidden, t.ff, GATE_FMT=kernel_format(t.gate_type, t.planar),
        UP_FMT=kernel_format(t.up_type, t.planar),
        ACT=ACTIVATIONS[math.activation], GATE_BIAS=math.gate_bias is not None,
        UP_BIAS=math.up_bias is not None, SUPER=whole, BM=block_m, BN=block_n,
        BK=block_k,
        E_POW2=triton.next_power_of_2(t.num_experts), INTERPRET=interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages)


def _launch_down(h: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
                 tile_ends: torch.Tensor, t: ExpertTables, y: torch.Tensor, block_m: int, grid_tiles: int,
                 config: MoeGemmConfig) -> None:
    bias = _biases(t)[2]
    whole = whole_super_blocks(t.down_type, t.ff)
    block_n, block_k = _fit(config.block_n, t.hidden), 32 if whole else _fit(config.block_k, t.ff)
    _down_kernel[(t.hidden // block_n, grid_tiles)](
        h, order, weights, ends, tile_ends, t.num_experts, t.down_ptrs, t.down_row_bytes,
        bias, y, t.hidden, t.ff, BIAS=t.math.down_bias is not None, DOWN_FMT=kernel_format(t.down_type, t.planar),
        SUPER=whole, BM=block_m, BN=block_n, BK=block_k,
        E_POW2=triton.next_power_of_2(t.num_experts),
        INTERPRET=interpreting(), num_warps=config.num_warps, num_stages=config.num_stages)


def whole_super_blocks(qtype: QType, cols: int) -> bool:
    """Whether rows of `qtype` and `cols` run by whole super-blocks (`_k4_super`: scales once per row and
    sub-block, 32 bytes of codes a load) rather than by groups of 16 (`_weight_tile`)."""
    return qtype == QType.Q4_K and cols % 256 == 0 and WHOLE_SUPER_BLOCKS


def _fit(block: int, size: int) -> int:
    """The largest block <= `block`, halving, that divides `size` (at least 16: sizes are multiples of 16)."""
    while block > 16 and size % block:
        block //= 2
    return block


def _biases(t: ExpertTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up and down biases (float32, contiguous, checked), or the address table as an unread stand-in."""
    math = t.math
    return tuple(t.gate_ptrs if b is None else b for b in (math.gate_bias, math.up_bias, math.down_bias))  # type: ignore[return-value]


def _check(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
           tables: ExpertTables) -> None:
    device, num_pairs = x.device, token_ids.shape[0]
    check_rows("x", x, (x.shape[0], tables.hidden), FLOAT_DTYPES, device)
    check_vector("token_ids", token_ids, num_pairs, INDEX_DTYPES, device)
    check_vector("bank_rows", bank_rows, num_pairs, INDEX_DTYPES, device)
    check_vector("weights", weights, num_pairs, FLOAT_DTYPES, device)
    for name in ("gate", "up", "down"):
        check_device(f"{name}_ptrs", getattr(tables, f"{name}_ptrs"), device)
        qtype = getattr(tables, f"{name}_type")
        if not has_kernel(qtype):
            raise ValueError(f"{name}: no tile kernel for {qtype.name} (formats: {[t.name for t in KERNEL_TYPES]})")
    if tables.hidden % GROUP or tables.ff % GROUP:
        raise ValueError(f"hidden {tables.hidden} and ff {tables.ff} must be multiples of {GROUP}")
    math = tables.math
    for name, cols in (("gate_bias", tables.ff), ("up_bias", tables.ff), ("down_bias", tables.hidden)):
        bias = getattr(math, name)
        if bias is not None:
            check_device(name, bias, device)
            if bias.dtype != torch.float32 or tuple(bias.shape) != (tables.num_experts, cols) \
                    or not bias.is_contiguous():
                raise ValueError(f"{name}: expected contiguous float32 {(tables.num_experts, cols)}, got "
                                 f"{bias.dtype} {tuple(bias.shape)}")
