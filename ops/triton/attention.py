"""Decode attention straight from the KV cache: split-K ("flash-decoding") in two launches.

Each decode token attends to positions 0..positions[i] of its slot in the contiguous cache
`[num_slots, kv_heads, max_len, head_dim]`. The first kernel runs one program per (token, kv head,
split of the positions): it reads its chunk of K/V once for all the q heads of the kv-head group
(GQA) and keeps an online softmax in float32. The second combines the splits of each (token, head)
by their log-sum-exp. Splits past a token's position (or before its window) do no work; loop bounds come from the loaded
positions and the grid from the shapes only, so a step can be captured in a CUDA graph. This
replaces a gather (a full copy of K/V), a mask and SDPA.

Multi-head latent attention (DeepSeek) reads a latent cache: each key is its row of `head_dim` values, each value
the first `value_dim` of them (the caches are views of one tensor), and every head of a token shares the one kv
head. The rest of the key (`head_dim - value_dim`, the rotary part) adds a second product to the scores.

A cache of q8_0 or q4_0 rows (`ops.kv_quant`) is dequantized tile by tile as the kernels read it, to q's
dtype, the same values as the torch reference's dequantized cache (or, with `SplitLaunch.f16_tiles`, to float16: each
value d * code rounded once, q and the probabilities in float16 beside them). `prefill_attention` is the causal
attention of a chunk of one sequence over such a cache (an unquantized one goes through SDPA), and the
KV write quantizes rows as it stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.kv_quant import check_head_dim, dense, latent_value_dim, row_bytes
from ops.quants import QType
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_vector, interpreting

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # (token, kv head, split) programs: ~2 per SM of a 132-SM H100/H200 (untuned)
_MIN_SPLIT_LEN = 256  # shorter splits add partials to combine for little K/V each; 256 keeps the smallest
# KV bucket of a captured decode step at one split, without the combine launch (H200: docs/benchmarks.md)
KV_BITS = {None: 0, QType.Q8_0: 8, QType.Q4_0: 4}  # the kernels' code of each cache type: bits per value
_EMULATE = tl.constexpr(interpreting())  # no inline PTX under the interpreter: the same values by plain ops


@dataclass(frozen=True)
class SplitLaunch:
    """How the split kernel is launched for a pair of cache types (`SPLIT_LAUNCH`)."""

    programs: int = _TARGET_PROGRAMS  # (token, kv head, split) programs wanted (`default_num_splits`)
    block_n: int = 0  # positions a tile (`tile_positions`); 0: tiles of at most 16 KiB
    num_warps: int = 8
    num_stages: int = 0  # 0: Triton's default
    codes_dot: bool = False  # a quantized side's products on its codes, its block scales applied to them (16-bit q)
    f16_tiles: bool = False  # a quantized side's tiles in float16, q and the probabilities too (16-bit q; `_q8_half`)


# (K bits, V bits) -> the launch; pairs not listed take SplitLaunch(). The fastest at 32k positions of
# .ci/gpu-kv-sweep.py on an H100 (docs/benchmarks.md, 2026-12-07): q8_0 with float16 tiles 35.2 us over caches past L2
# (plain tiles 39.3, the default 49.4; bf16's default 33.1), decode at 32k 0.973x bf16; q4_0 33.1 us over one layer's
# cache replayed (default 38.7), decode at 32k 0.952x.
SPLIT_LAUNCH: dict[tuple[int, int], SplitLaunch] = {
    (8, 8): SplitLaunch(block_n=128, num_warps=8, num_stages=3, f16_tiles=True),
    (4, 4): SplitLaunch(block_n=128, num_warps=4, num_stages=3),
}


@triton.jit
def _last_position(positions, token, max_len):
    # NOTE: positions in [0, max_len) is the caller's invariant (checking needs a host sync); the
    # clamp only keeps a bad one inside the slot
    return tl.minimum(tl.maximum(tl.load(positions + token).to(tl.int64), 0), max_len - 1)


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr):
    # WIDEN: 16-bit operands under the interpreter only: its tl.dot multiplies bf16 as their uint16 bits (Triton 3.9).
    # 16 bits -> float32 is exact and the GPU accumulates in float32, so the numbers stay the same.
    if WIDEN:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # ieee: no tf32 for float32 inputs; ignored for 16-bit


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    # float32 -> DTYPE to nearest even. WIDEN (the interpreter, bf16): its cast truncates (Triton 3.9), so
    # the rounding is done on the bits, as the GPU's cast and torch's do it
    if WIDEN and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(DTYPE)
    return out


@triton.jit
def _kv_tile(row, pos, cols, s_pos, mask, DTYPE: tl.constexpr, BITS: tl.constexpr, WIDEN: tl.constexpr):
    # values of one (slot, kv head)'s rows in DTYPE: keys `[D, BN]` (pos `[1, BN]`, cols `[D, 1]`) or values
    # `[BN, D]` (pos `[BN, 1]`, cols `[1, D]`), masked ones 0. q8_0 / q4_0 rows: `_quantized_rows`
    if BITS == 0:
        tile = tl.load(row + pos * s_pos + cols, mask=mask, other=0.0)
    elif pos.shape[0] == 1:  # keys
        tile = tl.trans(_quantized_rows(row, tl.reshape(pos, [pos.shape[1]]), tl.reshape(mask, [mask.shape[1]]),
                                        s_pos, DTYPE, BITS, WIDEN, cols.shape[0]))
    else:
        tile = _quantized_rows(row, tl.reshape(pos, [pos.shape[0]]), tl.reshape(mask, [mask.shape[0]]), s_pos,
                               DTYPE, BITS, WIDEN, cols.shape[1])
    return tile


@triton.jit
def _row_parts(row, pos, valid, s_pos, BITS: tl.constexpr, D: tl.constexpr):
    # rows `pos` `[BN]` of q8_0 / q4_0 values (`ops.kv_quant`: the D / 32 blocks' fp16 scales d, then their codes,
    # int8 or 16 bytes a block of 4-bit codes offset by 8: byte j's low nibble value j, its high one 16 + j) -> d
    # `[BN, D / 32]` float32 and the code bytes `[BN, D * BITS / 8]` uint8, 0 for rows not valid. A row's codes start
    # D / 16 bytes in and rows are D / 16 * 17 bytes: the codes are D / 16-byte aligned, read in vectors of that many
    NB: tl.constexpr = D // 32
    CODES: tl.constexpr = D * BITS // 8  # code bytes a row
    first = pos.to(tl.int64) * s_pos  # [BN]
    m = valid[:, None]
    d = tl.load(row.to(tl.pointer_type(tl.int16), bitcast=True) + (first // 2)[:, None] + tl.arange(0, NB)[None, :],
                mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, NB]
    at = tl.multiple_of(first + 2 * NB, D // 16)[:, None] + tl.max_contiguous(tl.arange(0, CODES), CODES)[None, :]
    return d, tl.load(row + at, mask=m, other=0)


@triton.jit
def _codes(raw, BITS: tl.constexpr, HALF: tl.constexpr):
    # code bytes `[BN, D * BITS / 8]` (`_row_parts`) -> the codes `[BN, D / 32, 32]`, float16 (HALF) or float32: exact.
    # NOTE: no int-to-float conversion (a quarter-rate instruction on sm_90): a code's offset binary (an int8's sign
    # bit flipped; a 4-bit code's offset 8) goes under the bits of 1024 (float16) or 2**23 (float32), and one exact
    # subtraction of that and the offset leaves the code
    magic: tl.constexpr = 0x6400 if HALF else 0x4B000000
    base: tl.constexpr = (1024.0 if HALF else 8388608.0) + (128.0 if BITS == 8 else 8.0)  # and the offset
    BN: tl.constexpr = raw.shape[0]
    NB: tl.constexpr = raw.shape[1] * 8 // BITS // 32
    bits = raw.to(tl.int16 if HALF else tl.int32)
    if BITS == 8:
        bits = bits ^ (magic | 0x80)
    else:
        b = tl.reshape(bits, [BN, NB, 16])
        bits = tl.permute(tl.join((b & 15) | magic, (b >> 4) | magic), (0, 1, 3, 2))
    codes = bits.to(tl.float16 if HALF else tl.float32, bitcast=True) - base
    return tl.reshape(codes, [BN, NB, 32])


@triton.jit
def _quantized_rows(row, pos, valid, s_pos, DTYPE: tl.constexpr, BITS: tl.constexpr, WIDEN: tl.constexpr,
                    D: tl.constexpr):
    # rows `pos` `[BN]` of q8_0 / q4_0 values (`_row_parts`) -> `[BN, D]` d * code in float32, rounded to DTYPE
    if DTYPE == tl.float16 and BITS == 8 and D % 64 == 0 and not _EMULATE:
        tile = _q8_half(row, pos, valid, s_pos, D)
    else:
        d, raw = _row_parts(row, pos, valid, s_pos, BITS, D)
        tile = _rounded(d[:, :, None] * _codes(raw, BITS, False), DTYPE, WIDEN)
    return tl.reshape(tile, [pos.shape[0], D])


@triton.jit
def _q8_half(row, pos, valid, s_pos, D: tl.constexpr):
    # rows `pos` `[BN]` of q8_0 values (`_row_parts`' layout; D a multiple of 64, so rows and their codes are 4-byte
    # aligned) -> float16 `[BN, D / 32, 32]`, each d * code rounded once (as `_rounded(d * code, float16)`), two values
    # an instruction: a code word's four bytes, sign bits flipped, go under the bits of 1024 in two fp16 pairs by byte
    # permutes, one subtraction of 1024 + 128 leaves the codes and one product scales them
    # NOTE: rows not valid read position 0's codes (in the cache, unmasked loads) and a scale of 0: their values 0
    NB: tl.constexpr = D // 32
    first = tl.where(valid, pos, 0).to(tl.int64) * s_pos  # [BN]
    d = tl.load(row.to(tl.pointer_type(tl.int16), bitcast=True) + (first // 2)[:, None] + tl.arange(0, NB)[None, :],
                mask=valid[:, None], other=0).to(tl.int32) & 0xFFFF  # [BN, NB] fp16 bits
    at = tl.multiple_of((first + 2 * NB) // 4, D // 64)[:, None] + \
        tl.max_contiguous(tl.arange(0, D // 4), D // 4)[None, :]  # a row's code words
    words = tl.reshape(tl.load(row.to(tl.pointer_type(tl.int32), bitcast=True) + at), [pos.shape[0], NB, 8])
    pairs = tl.broadcast_to((d | (d << 16))[:, :, None], words.shape)
    lo, hi = tl.inline_asm_elementwise(
        """{
        .reg .b32 t, top, base;
        xor.b32 t, $2, 0x80808080;
        mov.b32 top, 0x64646464;
        mov.b32 base, 0x64806480;
        prmt.b32 $0, t, top, 0x4140;
        prmt.b32 $1, t, top, 0x4342;
        sub.rn.f16x2 $0, $0, base;
        sub.rn.f16x2 $1, $1, base;
        mul.rn.f16x2 $0, $0, $3;
        mul.rn.f16x2 $1, $1, $3;
        }""", "=r,=r,r,r", [words, pairs], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    # [BN, NB, 8, 2, 2]: a word's value 2j + k is pair k's half j (lo: values 0, 1; hi: 2, 3)
    values = tl.join(tl.join(_half(lo), _half(hi)), tl.join(_half(lo >> 16), _half(hi >> 16)))
    return tl.reshape(values, [pos.shape[0], NB, 32])


@triton.jit
def _half(w):
    """The low 16 bits of int32 words as float16."""
    return w.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _code_blocks(row, pos, valid, s_pos, BITS: tl.constexpr, D: tl.constexpr):
    # rows `pos` `[BN]` of q8_0 / q4_0 values (`_row_parts`) -> their codes `[D / 32, BN, 32]` as float16 and their
    # blocks' scales `[D / 32, BN]`, 0 for rows not valid: a value is scale * code
    d, raw = _row_parts(row, pos, valid, s_pos, BITS, D)
    return tl.permute(_codes(raw, BITS, True), (1, 0, 2)), tl.permute(d, (1, 0))


@triton.jit
def _first_position(last, window):
    # the first position a token at `last` attends to: the last `window` positions up to its own (window > 0)
    return tl.where(window > 0, tl.maximum(last - window + 1, 0), 0)


@triton.jit
def _split_kernel(q, q_s0, q_s1, k, v, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, slot_ids, positions, max_len,
                  split_len, window, sinks, o, lse, qk_scale, GROUP: tl.constexpr, BG: tl.constexpr,
                  BN: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                  SINKS: tl.constexpr, WIDEN: tl.constexpr, CODES_DOT: tl.constexpr, F16_TILES: tl.constexpr):
    # program (token, kv head, split); rows of the tile are the group's q heads (padded to BG >= 16
    # for tl.dot), so K/V is read once per group. Scores are in the log2 domain (exp2 is cheaper).
    # D: the values' width and the keys' first columns; ROPE > 0: the keys' D.. D + ROPE columns (a latent cache).
    # CODES_DOT (16-bit q, ROPE 0): a quantized side's products take its codes as float16, one product a block of 32
    # columns, and its blocks' scales apply to the products (keys: to a block's scores; values: to the
    # probabilities a block's columns are weighted with), in place of a tile of scale * code values; q, and the
    # probabilities times a value block's scale, go to the tensor cores as float16 (a q past 65,504 would overflow)
    # F16_TILES (16-bit q, ROPE 0): a quantized side's tiles are float16 values (`_q8_half`), and q goes to the tensor
    # cores as float16 beside a quantized key tile
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads, num_splits = tl.num_programs(1) * GROUP, tl.num_programs(2)
    slot = tl.load(slot_ids + token).to(tl.int64)
    last = _last_position(positions, token, max_len)
    first = _first_position(last, window)
    start = tl.maximum(split.to(tl.int64) * split_len, first)
    end = tl.minimum(split.to(tl.int64) * split_len + split_len, last + 1)
    rows, cols = tl.arange(0, BG), tl.arange(0, D)
    heads = kv_head * GROUP + rows
    q_ptrs = q + token.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + cols[None, :]
    q_tile = tl.load(q_ptrs, mask=rows[:, None] < GROUP, other=0.0)
    if ROPE:
        rope_cols = D + tl.arange(0, ROPE)
        q_rope = tl.load(q + token.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + rope_cols[None, :],
                         mask=rows[:, None] < GROUP, other=0.0)
    k_base = k + slot * k_s0 + kv_head * k_s1
    v_base = v + slot * v_s0 + kv_head * v_s1
    m = tl.full([BG], float("-inf"), tl.float32)
    l_sum = tl.zeros([BG], tl.float32)
    if SINKS:  # each head's sink logit joins the softmax of the token's first split that holds work, adding nothing
        is_first = split == first // split_len
        sink = tl.load(sinks + heads, mask=rows < GROUP, other=0.0) * 1.4426950408889634  # log2 domain
        m = tl.where(is_first, sink, m)
        l_sum = tl.where(is_first, 1.0, l_sum)
    NB: tl.constexpr = D // 32
    K_CODES: tl.constexpr = CODES_DOT and K_BITS > 0
    V_CODES: tl.constexpr = CODES_DOT and V_BITS > 0
    K_DTYPE: tl.constexpr = tl.float16 if F16_TILES and K_BITS > 0 else q.dtype.element_ty
    V_DTYPE: tl.constexpr = tl.float16 if F16_TILES and V_BITS > 0 else q.dtype.element_ty
    if K_CODES:
        q_blocks = tl.permute(tl.reshape(q_tile.to(tl.float16), [BG, NB, 32]), (1, 0, 2))  # [NB, BG, 32]
    elif K_DTYPE != q.dtype.element_ty:
        q_tile = q_tile.to(K_DTYPE)
    if V_CODES:
        acc = tl.zeros([NB, BG, 32], tl.float32)
    else:
        acc = tl.zeros([BG, D], tl.float32)
    for n0 in range(start, end, BN):
        offs = n0 + tl.arange(0, BN)
        valid = offs < end
        if K_CODES:
            kc, kd = _code_blocks(k_base, offs, valid, k_s2, K_BITS, D)  # [NB, BN, 32], [NB, BN]
            s = tl.sum(_dot(q_blocks, tl.permute(kc, (0, 2, 1)), WIDEN) * kd[:, None, :], axis=0)  # [BG, BN]
        else:
            kt = _kv_tile(k_base, offs[None, :], cols[:, None], k_s2, valid[None, :], K_DTYPE, K_BITS,
                          WIDEN)  # [D, BN]
            s = _dot(q_tile, kt, WIDEN)
        if ROPE:
            s += _dot(q_rope, tl.load(k_base + offs[None, :] * k_s2 + rope_cols[:, None], mask=valid[None, :],
                                      other=0.0), WIDEN)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds a valid position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if V_CODES:
            vc, vd = _code_blocks(v_base, offs, valid, v_s2, V_BITS, D)  # [NB, BN, 32], [NB, BN]
            weights = (p[None, :, :] * vd[:, None, :]).to(tl.float16)  # [NB, BG, BN]
            acc = acc * alpha[None, :, None] + _dot(weights, vc, WIDEN)
        else:
            vt = _kv_tile(v_base, offs[:, None], cols[None, :], v_s2, valid[:, None], V_DTYPE, V_BITS,
                          WIDEN)  # [BN, D]
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, WIDEN)
        m = m_new
    if V_CODES:
        acc = tl.reshape(tl.permute(acc, (1, 0, 2)), [BG, D])
    # o and lse are [tokens, heads, splits(, D)]; with one split o is the output itself
    has_work = start < end
    l_sum = tl.where(has_work, l_sum, 1.0)  # an empty split's rows are not stored
    out_rows = (token * num_heads + heads).to(tl.int64) * num_splits + split
    is_row = rows < tl.where(has_work, GROUP, 0)  # not `& has_work`: the interpreter mis-broadcasts that
    tl.store(o + out_rows[:, None] * D + cols[None, :], acc / l_sum[:, None], mask=is_row[:, None])
    tl.store(lse + out_rows, m + tl.log2(l_sum), mask=is_row)


@triton.jit
def _combine_kernel(o, lse, positions, max_len, split_len, num_splits, window, out, D: tl.constexpr):
    # program (token, head): only the splits that hold work are read (the others were not written)
    token, head = tl.program_id(0), tl.program_id(1)
    last = _last_position(positions, token, max_len)
    used = tl.minimum(last // split_len + 1, num_splits)
    lowest = _first_position(last, window) // split_len
    row = (token * tl.num_programs(1) + head).to(tl.int64)
    cols = tl.arange(0, D)
    m = tl.load(lse + row * num_splits + lowest)  # the split of the first position always holds work
    weight = 0.0
    acc = tl.zeros([D], tl.float32)
    for split in range(lowest, used):
        lse_s = tl.load(lse + row * num_splits + split)
        m_new = tl.maximum(m, lse_s)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse_s - m_new)
        acc = acc * alpha + w * tl.load(o + (row * num_splits + split) * D + cols)
        weight = weight * alpha + w
        m = m_new
    tl.store(out + row * D + cols, acc / weight)


def tile_positions(launch: SplitLaunch, head_dim: int, q_bytes: int) -> int:
    """Positions a tile of the split kernel, a power of two: the launch's at head_dim <= 128 and 16-bit q, fewer for
    wider heads and float32 q (the same bytes); by default K and V tiles of at most 16 KiB each (no register spills on
    sm_90 at 8 warps, checked in ptxas)."""
    wide = (launch.block_n * 128 // max(head_dim, 128) or 8192 // head_dim) // (q_bytes // 2)
    return max(16, min(launch.block_n or 64, 1 << wide.bit_length() - 1))


def default_num_splits(num_tokens: int, kv_heads: int, max_len: int, programs: int = _TARGET_PROGRAMS) -> int:
    """Splits of the positions: about `programs` programs, none shorter than _MIN_SPLIT_LEN."""
    wanted = triton.cdiv(programs, max(1, num_tokens * kv_heads))
    return max(1, min(wanted, triton.cdiv(max_len, _MIN_SPLIT_LEN)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     positions: torch.Tensor, scale: float, num_splits: int | None = None,
                     k_qtype: QType | None = None, v_qtype: QType | None = None, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[n, num_heads, head_dim]`; k_cache `[num_slots, kv_heads, max_len, head_dim]`, v_cache `[num_slots,
    kv_heads, max_len, value_dim]` (any strides but the last: a view of the first `length` positions splits by
    `length`; value_dim = head_dim, or a latent cache's narrower values, a power of two the keys exceed by another);
    slot_ids, positions int32/int64 `[n]` -> `[n, num_heads, value_dim]` in q's dtype. Token i attends to
    positions 0..positions[i] of slot slot_ids[i] (the last `window` of them where window > 0); head h reads kv
    head h // (num_heads // kv_heads). sinks: float32 `[num_heads]`, a logit per head that joins each softmax and
    adds nothing (`ops.fused.attention`).
    num_splits: chunks of the positions (None: `default_num_splits`, from the shapes only).
    k_qtype, v_qtype: a cache of q8_0 / q4_0 rows, uint8 `[..., row_bytes]` (None: rows in q's dtype).
    NOTE: slot_ids in [0, num_slots) and positions in [0, max_len) are not checked (no host sync)."""
    n, num_heads, head_dim, value_dim = _check_caches(q, k_cache, v_cache, k_qtype, v_qtype)
    check_vector("slot_ids", slot_ids, n, INDEX_DTYPES, q.device)
    check_vector("positions", positions, n, INDEX_DTYPES, q.device)
    if window < 0:
        raise ValueError(f"window: expected 0 (none) or a positive number of positions, got {window}")
    if sinks is not None:
        check_vector("sinks", sinks, num_heads, (torch.float32,), q.device)
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((n, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    bits = KV_BITS[k_qtype], KV_BITS[v_qtype]
    launch = SPLIT_LAUNCH.get(bits, SplitLaunch())
    block_n = tile_positions(launch, head_dim, q.element_size())
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: expected at least 1, got {num_splits}")
    wanted = num_splits or default_num_splits(n, kv_heads, max_len, launch.programs)
    split_len = triton.cdiv(triton.cdiv(max_len, wanted), block_n) * block_n
    splits = triton.cdiv(max_len, split_len)  # none entirely past max_len
    group = num_heads // kv_heads
    codes_dot = launch.codes_dot and q.dtype != torch.float32 and head_dim == value_dim and bits != (0, 0)
    f16_tiles = launch.f16_tiles and not codes_dot and q.dtype != torch.float32 and head_dim == value_dim
    o = out if splits == 1 else torch.empty((n, num_heads, splits, value_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, num_heads, splits), dtype=torch.float32, device=q.device)
    _split_kernel[(n, kv_heads, splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, *k_cache.stride()[:3], *v_cache.stride()[:3],
        slot_ids, positions, max_len, split_len, window, lse if sinks is None else sinks, o, lse, scale * _LOG2E,
        GROUP=group, BG=max(16, triton.next_power_of_2(group)), BN=block_n, D=value_dim, ROPE=head_dim - value_dim,
        K_BITS=bits[0], V_BITS=bits[1], SINKS=sinks is not None,
        WIDEN=interpreting() and q.dtype != torch.float32, CODES_DOT=codes_dot,
        F16_TILES=f16_tiles,
        num_warps=launch.num_warps, **({"num_stages": launch.num_stages} if launch.num_stages else {}))
    if splits > 1:
        _combine_kernel[(n, num_heads)](o, lse, positions, max_len, split_len, splits, window, out, D=value_dim,
                                        num_warps=1 if value_dim <= 128 else 2)
    return out


def _check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_qtype: QType | None,
                  v_qtype: QType | None) -> tuple[int, int, int, int]:
    """(n, num_heads, head_dim, value_dim) of a decode attention's arguments."""
    device = q.device
    check_device("q", q, device)
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: expected one of {FLOAT_DTYPES}, got {q.dtype}")
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q: expected [n, num_heads, head_dim] with contiguous rows, got {tuple(q.shape)} "
                         f"strides {q.stride()}")
    n, num_heads, head_dim = q.shape
    value_dim = latent_value_dim(head_dim, v_cache, k_qtype, v_qtype)
    if not _is_kernel_dim(value_dim) or (value_dim != head_dim and not _is_kernel_dim(head_dim - value_dim)):
        raise ValueError(f"q: head_dim must be a power of two in [16, 512], or a latent cache's values that and its "
                         f"keys another more; got {head_dim} and values {value_dim}")
    _check_cache("k_cache", k_cache, k_qtype, q.dtype, head_dim, device)
    _check_cache("v_cache", v_cache, v_qtype, q.dtype, value_dim, device)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: expected the slots, kv heads and positions of k_cache {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if kv_heads == 0 or num_heads % kv_heads or max_len == 0:
        raise ValueError(f"k_cache: {kv_heads} kv heads and {max_len} positions do not serve {num_heads} heads")
    return n, num_heads, head_dim, value_dim


def _is_kernel_dim(dim: int) -> bool:
    return 16 <= dim <= 512 and dim & (dim - 1) == 0


def _check_cache(name: str, cache: torch.Tensor, qtype: QType | None, dtype: torch.dtype, head_dim: int,
                 device: torch.device) -> None:
    """`[num_slots, kv_heads, max_len, row]` with contiguous rows: `dtype` values or uint8 blocks of qtype."""
    check_device(name, cache, device)
    if qtype not in KV_BITS:
        raise ValueError(f"{name}: no kernel reads a {qtype} cache (types: {', '.join(map(str, KV_BITS))})")
    check_head_dim(qtype, head_dim)
    expected = dtype if qtype is None else torch.uint8
    if cache.dtype != expected:
        raise ValueError(f"{name}: expected {expected} rows (the dtype of q, or uint8 blocks of a quantized type), "
                         f"got {cache.dtype}")
    row = row_bytes(qtype, head_dim, dtype) // expected.itemsize
    if cache.dim() != 4 or cache.shape[3] != row or cache.stride(3) != 1:
        raise ValueError(f"{name}: expected [num_slots, kv_heads, max_len, {row}] with contiguous rows, "
                         f"got {tuple(cache.shape)} strides {cache.stride()}")


@triton.jit
def _prefill_kernel(q, q_s0, q_s1, k, v, k_s1, k_s2, v_s1, v_s2, start, num_tokens, o, o_s0, o_s1, qk_scale,
                    GROUP: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                    K_BITS: tl.constexpr, V_BITS: tl.constexpr, WIDEN: tl.constexpr):
    # program (block of BM tokens, kv head) of one sequence; rows of the tile are (token, q head of the
    # group) pairs, so K/V is read once per block and group. Causal: the token at position p reads 0..p.
    block, kv_head = tl.program_id(0), tl.program_id(1)
    rows, cols = tl.arange(0, BM * BG), tl.arange(0, D)
    token = block * BM + rows // BG
    heads = kv_head * GROUP + rows % BG
    is_row = (token < num_tokens) & (rows % BG < GROUP)
    query_pos = start + tl.minimum(token, num_tokens - 1)  # [rows]; padding rows repeat the last token
    q_tile = tl.load(q + token[:, None].to(tl.int64) * q_s0 + heads[:, None] * q_s1 + cols[None, :],
                     mask=is_row[:, None], other=0.0)
    k_base, v_base = k + kv_head * k_s1, v + kv_head * v_s1
    end = start + tl.minimum(block * BM + BM, num_tokens)  # keys of the block's last token, + 1
    m = tl.full([BM * BG], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM * BG], tl.float32)
    acc = tl.zeros([BM * BG, D], tl.float32)
    for n0 in range(0, end, BN):
        offs = n0 + tl.arange(0, BN)
        valid = offs < end
        kt = _kv_tile(k_base, offs[None, :], cols[:, None], k_s2, valid[None, :], q.dtype.element_ty, K_BITS,
                      WIDEN)
        s = _dot(q_tile, kt, WIDEN) * qk_scale
        s = tl.where(offs[None, :] <= query_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: position 0 is in the first block of every row
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt = _kv_tile(v_base, offs[:, None], cols[None, :], v_s2, valid[:, None], q.dtype.element_ty, V_BITS,
                      WIDEN)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, WIDEN)
        m = m_new
    out = o + token[:, None].to(tl.int64) * o_s0 + heads[:, None] * o_s1 + cols[None, :]
    tl.store(out, (acc / l_sum[:, None]).to(o.dtype.element_ty), mask=is_row[:, None])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int,
                      scale: float, k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    """Causal attention of one sequence's chunk: q `[n, num_heads, head_dim]` at positions start..start+n-1
    of slot `slot` of the caches (as `decode_attention`'s), whose positions 0..start+n-1 hold its keys and
    values -> `[n, num_heads, head_dim]` in q's dtype; token i attends to positions 0..start+i."""
    n, num_heads, head_dim, value_dim = _check_caches(q, k_cache, v_cache, k_qtype, v_qtype)
    if value_dim != head_dim:
        raise ValueError(f"v_cache: the prefill kernel reads values as wide as the keys ({head_dim}), got {value_dim} "
                         f"(a latent cache's prompt goes through SDPA)")
    num_slots, kv_heads, max_len = k_cache.shape[:3]
    if not 0 <= slot < num_slots or start < 0 or start + n > max_len:
        raise ValueError(f"slot {slot} and positions {start}..{start + n - 1} are outside the caches' "
                         f"{num_slots} slots of {max_len} positions")
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    group = num_heads // kv_heads
    bg = triton.next_power_of_2(group)
    rows = 64 if head_dim <= 128 else 32  # (token, head) rows of a tile; untuned
    block_m = max(1, rows // bg)
    k, v = k_cache[slot], v_cache[slot]  # [kv_heads, max_len, row] views
    _prefill_kernel[(triton.cdiv(n, block_m), kv_heads)](
        q, q.stride(0), q.stride(1), k, v, *k.stride()[:2], *v.stride()[:2], start, n, out, out.stride(0),
        out.stride(1), scale * _LOG2E, GROUP=group, BG=bg, BM=block_m, BN=32, D=head_dim,
        K_BITS=KV_BITS[k_qtype], V_BITS=KV_BITS[v_qtype], WIDEN=interpreting() and q.dtype == torch.bfloat16,
        num_warps=4)
    return out


@triton.jit
def _quantize_row(src, dst, head_dim, NB: tl.constexpr, BITS: tl.constexpr):
    # one row of head_dim float values -> its blocks of 32 as gguf's quantizers make them (each division
    # rounded to nearest, launched without fp fusion so that products are rounded before the adds), the blocks'
    # scales first, then their codes (`ops.kv_quant`)
    blocks = tl.arange(0, NB)
    in_row = blocks < head_dim // 32
    dst_codes = dst + 2 * (head_dim // 32) + blocks * (4 * BITS)  # [NB]: the row's scales, then its codes
    dst_scale = dst + 2 * blocks
    if BITS == 8:
        j = tl.arange(0, 32)[None, :]
        x = tl.load(src + blocks[:, None] * 32 + j, mask=in_row[:, None], other=0.0).to(tl.float32)  # [NB, 32]
        d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
        scaled = x * tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))[:, None]
        a = tl.abs(scaled)
        floored = tl.floor(a)
        rounded = floored + tl.floor(2 * (a - floored))  # C roundf: halves away from zero
        codes = tl.where(scaled < 0, -rounded, rounded).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(dst_codes[:, None] + j, codes, mask=in_row[:, None])
    else:
        j = tl.arange(0, 16)[None, :]  # low nibbles hold values 0..15 of a block, high ones 16..31
        lo = tl.load(src + blocks[:, None] * 32 + j, mask=in_row[:, None], other=0.0).to(tl.float32)  # [NB, 16]
        hi = tl.load(src + blocks[:, None] * 32 + 16 + j, mask=in_row[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))[:, None]
        first = tl.minimum(tl.min(tl.where(tl.abs(lo) == amax, j, 32), axis=1),
                           tl.min(tl.where(tl.abs(hi) == amax, j + 16, 32), axis=1))[:, None]
        peak = tl.sum(tl.where(j == first, lo, 0.0), axis=1) + tl.sum(tl.where(j + 16 == first, hi, 0.0), axis=1)
        d = tl.math.div_rn(peak, -8.0)  # the signed value of largest magnitude (the first one) is code 0
        inv = tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))[:, None]
        code_lo = tl.minimum(tl.maximum((lo * inv + 8.5).to(tl.int32), 0), 15)  # truncated, as gguf
        code_hi = tl.minimum(tl.maximum((hi * inv + 8.5).to(tl.int32), 0), 15)
        tl.store(dst_codes[:, None] + j, (code_lo | (code_hi << 4)).to(tl.uint8), mask=in_row[:, None])
    bits = d.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(dst_scale, (bits & 255).to(tl.uint8), mask=in_row)
    tl.store(dst_scale + 1, (bits >> 8).to(tl.uint8), mask=in_row)


@triton.jit
def _write_row(src, dst, head_dim, BLOCK: tl.constexpr, BITS: tl.constexpr):
    if BITS == 0:
        cols = tl.arange(0, BLOCK)
        tl.store(dst + cols, tl.load(src + cols, mask=cols < head_dim), mask=cols < head_dim)
    else:
        _quantize_row(src, dst, head_dim, BLOCK // 32, BITS)


@triton.jit
def _write_kv_kernel(k, v, k_s0, k_s1, v_s0, v_s1, k_cache, v_cache, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                     num_slots, slot_ids, positions, max_len, head_dim, BLOCK: tl.constexpr, K_BITS: tl.constexpr,
                     V_BITS: tl.constexpr):
    # program (token, kv head): its key and value rows into (slot, head, position) of both caches
    token, head = tl.program_id(0), tl.program_id(1)
    # NOTE: slots and positions in range are the caller's invariant; the clamps keep a bad one inside
    slot = tl.minimum(tl.maximum(tl.load(slot_ids + token).to(tl.int64), 0), num_slots - 1)
    position = _last_position(positions, token, max_len)
    _write_row(k + token.to(tl.int64) * k_s0 + head * k_s1, k_cache + slot * kc_s0 + head * kc_s1 + position * kc_s2,
               head_dim, BLOCK, K_BITS)
    _write_row(v + token.to(tl.int64) * v_s0 + head * v_s1, v_cache + slot * vc_s0 + head * vc_s1 + position * vc_s2,
               head_dim, BLOCK, V_BITS)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_qtype: QType | None = None, v_qtype: QType | None = None) -> None:
    """k, v `[n, kv_heads, head_dim]` (head_dim contiguous, any other strides) stored at (slot_ids[i],
    positions[i]) of the caches `[num_slots, kv_heads, max_len, row]` (one layer): rows of k's dtype, or
    quantized to uint8 blocks of k_qtype / v_qtype. One launch for both. (slot, position) pairs are
    distinct (a decode or prefill batch)."""
    device = k_cache.device
    unquantized = [c.dtype for c, qtype in ((k_cache, k_qtype), (v_cache, v_qtype)) if qtype is None]
    dtype = unquantized[0] if unquantized else k.dtype  # the rows' dtype
    for name, t in (("k", k), ("v", v)):
        check_device(name, t, device)
        if t.dtype != dtype or dtype not in FLOAT_DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {dtype} (the rows of an unquantized cache, one of {FLOAT_DTYPES}) "
                             f"with contiguous rows, got {t.dtype} strides {t.stride()}")
    n, kv_heads, head_dim = k.shape if k.dim() == 3 else (0, 0, 0)
    for name, cache, qtype in (("k_cache", k_cache, k_qtype), ("v_cache", v_cache, v_qtype)):
        _check_cache(name, cache, qtype, k.dtype, head_dim, device)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: expected the slots, kv heads and positions of k_cache {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    num_slots, cache_heads, max_len = k_cache.shape[:3]
    if k.dim() != 3 or cache_heads != kv_heads or v.shape != k.shape:
        raise ValueError(f"k, v: expected [n, {cache_heads}, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    check_vector("slot_ids", slot_ids, n, INDEX_DTYPES, device)
    check_vector("positions", positions, n, INDEX_DTYPES, device)
    if n:
        _write_kv_kernel[(n, kv_heads)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache, v_cache,
                                        *k_cache.stride()[:3], *v_cache.stride()[:3], num_slots, slot_ids, positions,
                                        max_len, head_dim, BLOCK=max(32, triton.next_power_of_2(head_dim)),
                                        K_BITS=KV_BITS[k_qtype], V_BITS=KV_BITS[v_qtype], num_warps=1,
                                        enable_fp_fusion=False)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                           positions: torch.Tensor, scale: float, k_qtype: QType | None = None,
                           v_qtype: QType | None = None, window: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: per token, the slot's keys up to its position (the last `window` of them where window > 0;
    dequantized to q's dtype), kv heads repeated, float32 softmax with each head's sink logit beside the scores."""
    group, head_dim = q.shape[1] // k_cache.shape[1], q.shape[2]
    out = q.new_empty((*q.shape[:2], latent_value_dim(head_dim, v_cache, k_qtype, v_qtype)))
    for i in range(q.shape[0]):
        slot, last = int(slot_ids[i]), int(positions[i])
        first = max(0, last - window + 1) if window else 0
        keys = dense(k_cache[slot, :, first:last + 1], k_qtype, head_dim, q.dtype)
        values = dense(v_cache[slot, :, first:last + 1], v_qtype, head_dim, q.dtype)
        keys = keys.float().repeat_interleave(group, dim=0)  # [heads, len, head_dim]
        values = values.float().repeat_interleave(group, dim=0)
        scores = (keys @ q[i].float()[:, :, None])[:, :, 0] * scale  # [heads, len]
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().cpu().to(scores.device)[:, None]], dim=1)
        probs = torch.softmax(scores, dim=-1)[:, :values.shape[1]]
        out[i] = (probs[:, None, :] @ values)[:, 0].to(q.dtype)
    return out

