"""Raw GGUF rows -> dense bf16/fp16/fp32 weights on the GPU, for a dense grouped GEMM (prefill).

Prefill expands whole layers of experts at once (e.g. 128 experts x 768 x 2048 weights per tensor),
so this is a streaming job: 0.5 to 1.1 bytes in, 2 to 4 bytes out per weight. Rows are contiguous, so
the blocks of all rows form one sequence; each program expands BLOCKS consecutive blocks. Its tile is
`[BLOCKS, R, 32 // VEC, VEC]` over runs of 32 code bytes per block (R runs); a thread holds VEC
consecutive bytes of a run (one vector load) and writes every weight they hold (both nibbles, all
bit planes) as stores of VEC consecutive outputs, 16 bytes each. Loads and stores share that
register layout, and the scales are computed once per run of VEC bytes, not per weight. The grid
depends only on the shapes: no host sync, and a launch can be captured in a CUDA graph.

Q4_K, Q5_K, Q6_K and Q8_0 run dedicated kernels that give exactly the float32 values of `ops.quants`
(the same products, rounded as there), rounded once to the output dtype. Every other format runs the
torch reference of `ops.quants` and a cast (the table formats IQ4_NL, IQ4_XS and MXFP4 upload a lookup
table per call there, so those cannot be graph-captured).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.quants import format_of, row_bytes
from ops.triton.checks import FLOAT_DTYPES, check_device, interpreting
from ops.triton.tables import QType

Q4_K = tl.constexpr(int(QType.Q4_K))
Q5_K = tl.constexpr(int(QType.Q5_K))
Q6_K = tl.constexpr(int(QType.Q6_K))
Q8_0 = tl.constexpr(int(QType.Q8_0))
# (blocks per program, runs of 32 code bytes per block): 2048 or 4096 code bytes, 4096 to 8192 weights a program
TILES = {QType.Q4_K: (16, 4), QType.Q5_K: (16, 4), QType.Q6_K: (32, 2), QType.Q8_0: (128, 1)}
NUM_WARPS = 8


def has_kernel(qtype: QType) -> bool:
    return qtype in TILES


# --- shared pieces -----------------------------------------------------------------------------------


@triton.jit
def _float(code, bias: tl.constexpr):
    """int32 codes in [0, 2**23) -> float32 code - bias, exact: OR-ed into the mantissa of 2**23, the
    code is 2**23 + code as a float (an OR and a subtraction instead of a quarter-rate conversion)."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16_at(p):
    """The little-endian fp16 at byte pointers p (any alignment) -> float32."""
    return (_byte(p) | (_byte(p + 1) << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store(dst, w, keep, ROUND_BF16: tl.constexpr):
    # NOTE: the interpreter's float32 -> bf16 cast truncates, the GPU's rounds to nearest even:
    # ROUND_BF16 (interpreter only) rounds in integer ops (finite w) so that both give the same bits
    if ROUND_BF16:
        bits = w.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(dst, rounded, mask=keep)
    else:
        tl.store(dst, w.to(dst.dtype.element_ty), mask=keep)


# --- Q4_K / Q5_K: fp16 d, dmin; 12 bytes of 6-bit (scale, min); [32 bytes of fifth bits]; 128 of nibbles


@triton.jit
def _scale_min_k4(p, g):
    """6-bit scale and min of sub-blocks g (`_scale_min_k4` of ops.quants; p: the 12 packed bytes): g < 4:
    b[g] & 63, b[g + 4] & 63; else (b[g + 4] & 15) | (b[g - 4] >> 6) << 4, (b[g + 4] >> 4) | (b[g] >> 6) << 4."""
    a, b, c = _byte(p + g), _byte(p + g + 4), _byte(p + g % 4)
    is_low = g < 4
    sc = tl.where(is_low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(is_low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def _affine_k(src, dst, keep, run, c, FIFTH: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Run j (`run`) of qs bytes: byte c holds weight 64j + c (low nibble, sub-block 2j) and 64j + 32 + c (high
    nibble, 2j + 1); Q5_K (FIFTH) adds bit g of qh byte c as bit 4 of sub-block g. w = (d * sc) * q - dmin * m."""
    d, dmin = _f16_at(src), _f16_at(src + 2)
    qs = _byte(src + 16 + 32 * FIFTH + 32 * run + c)
    qh = qs
    if FIFTH:  # the same qh bytes for every run: full tile shape, so that the load takes the tile's layout
        qh = _byte(src + 16 + c + 0 * run) << 4
    for n in tl.static_range(2):
        g = 2 * run + n
        sc, mn = _scale_min_k4(src + 4, g)
        q = (qs >> 4 * n) & 15
        if FIFTH:
            q = q | ((qh >> g) & 16)
        # NOTE: d * sc (17 significant bits) and that times q (22) are exact in float32, so the one
        # rounding of the subtraction is the reference's even where the compiler fuses it into an FMA
        w = (d * _float(sc, 0.0)) * _float(q, 0.0) - dmin * _float(mn, 0.0)
        _store(dst + 32 * g + c, w, keep, ROUND_BF16)


# --- Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, int8 scales[16], fp16 d --------------------


@triton.jit
def _q6_k(src, dst, keep, half, c, c_start, ROUND_BF16: tl.constexpr):
    """Half h of the block: weight 128h + 32a + c (a < 4) is nibble a // 2 of ql byte 64h + 32 (a % 2) + c
    with bits 2a of qh byte 32h + c above it; sub-blocks of 16 weights. w = (d * sc) * (q - 32)."""
    d = _f16_at(src + 208)
    low0, low1 = _byte(src + 64 * half + c), _byte(src + 64 * half + 32 + c)
    high = _byte(src + 128 + 32 * half + c)
    for a in tl.static_range(4):
        low = low0
        if a % 2 == 1:
            low = low1
        q = ((low >> 4 * (a // 2)) & 15) | (((high >> 2 * a) & 3) << 4)
        # int8 scale of the run's sub-block (c_start: first c of the thread's VEC bytes, same sub-block);
        # (byte ^ 0x80) is the scale + 128
        sc = _byte(src + 192 + 8 * half + 2 * a + c_start // 16) ^ 0x80
        w = (d * _float(sc, 128.0)) * _float(q, 32.0)
        _store(dst + 128 * half + 32 * a + c, w, keep, ROUND_BF16)


# --- Q8_0: fp16 d, int8 qs[32] ----------------------------------------------------------------------


@triton.jit
def _q8_0(src, dst, keep, c, ROUND_BF16: tl.constexpr):
    _store(dst + c, _f16_at(src) * _float(_byte(src + 2 + c) ^ 0x80, 128.0), keep, ROUND_BF16)


# --- kernel and launcher ------------------------------------------------------------------------------


@triton.jit
def _dequant_kernel(raw, out, num_blocks, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCKS: tl.constexpr, RUNS: tl.constexpr, VEC: tl.constexpr, ROUND_BF16: tl.constexpr):
    # program: blocks pid * BLOCKS .. + BLOCKS - 1, tile [BLOCKS, RUNS, 32 // VEC, VEC] of code bytes
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    keep = (blk < num_blocks)[:, None, None, None]
    # loads read a valid block (the last one) past the end; only stores are masked
    src = raw + (tl.minimum(blk, num_blocks - 1) * TYPE_SIZE)[:, None, None, None]
    dst = out + (blk * BLOCK_SIZE)[:, None, None, None]
    run = tl.arange(0, RUNS)[None, :, None, None]
    c_start = VEC * tl.arange(0, 32 // VEC)[None, None, :, None]
    c = c_start + tl.arange(0, VEC)[None, None, None, :]
    if FMT == Q4_K or FMT == Q5_K:
        _affine_k(src, dst, keep, run, c, FMT == Q5_K, ROUND_BF16)
    elif FMT == Q6_K:
        _q6_k(src, dst, keep, run, c, c_start, ROUND_BF16)
    else:
        tl.static_assert(FMT == Q8_0, "dequantize: no kernel for this format")
        _q8_0(src, dst, keep, c, ROUND_BF16)


def dequantize_rows(raw: torch.Tensor, qtype: QType, cols: int, out: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """raw uint8 `[rows, row_bytes(qtype, cols)]` (contiguous) -> `[rows, cols]` of `dtype` (bf16, fp16
    or fp32), written into `out` (contiguous, of `dtype`) if given: `ops.quants`' float32 weights
    rounded to `dtype`."""
    qtype = QType(qtype)
    _check_raw(raw, qtype, cols)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
    rows = raw.shape[0]
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=raw.device)
    check_device("out", out, raw.device)
    if out.dtype != dtype or tuple(out.shape) != (rows, cols) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {(rows, cols)} of {dtype}, got {out.dtype} "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if out.numel() == 0:
        return out
    fmt = format_of(qtype)
    blocks = raw.view(-1, fmt.type_size)
    if not has_kernel(qtype):
        out.copy_(fmt.dequantize_blocks(blocks).view(rows, cols))
        return out
    num_blocks, (per_program, runs) = blocks.shape[0], TILES[qtype]
    _dequant_kernel[(triton.cdiv(num_blocks, per_program),)](
        raw, out, num_blocks, FMT=int(qtype), TYPE_SIZE=fmt.type_size, BLOCK_SIZE=fmt.block_size,
        BLOCKS=per_program, RUNS=runs, VEC=16 // out.element_size(),
        ROUND_BF16=interpreting() and dtype == torch.bfloat16, num_warps=NUM_WARPS)
    return out


def _check_raw(raw: torch.Tensor, qtype: QType, cols: int) -> None:
    check_device("raw", raw, raw.device)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous():
        raise ValueError(f"raw: expected contiguous 2-D uint8, got {raw.dtype} {tuple(raw.shape)} "
                         f"with strides {raw.stride()}")
    expected = row_bytes(qtype, cols)  # ValueError for an unknown type or a partial block
    if raw.shape[1] != expected:
        raise ValueError(f"raw: {qtype.name} rows of {cols} take {expected} bytes, got {raw.shape[1]}")
