"""Dot products of quantized GGUF weight rows with a few activation rows, one function per format.

`rows_dot` returns, for BR rows of one or two experts' matrices (a, b) and up to 4 activation rows
(slots), `sum_k W[row, k] * X[slot, k]` as `[BR]` float32 per (matrix, slot).

Codes become floats without int->float conversions (quarter-rate on Hopper): a field of a 32-bit
word OR-ed into the mantissa of 2**23 is f = 2**23 + code * 2**e, exact, and one FMA,
f * s - 2**23 * s, gives code * 2**e * s rounded once (s: the sub-block scale). The activations were
multiplied by 2**-e beforehand (`ops.triton.prepare`), so the product is code * s * x. A block's
offset (the min of Q4_K/Q5_K, the code bias 32 of Q6_K, 128 of Q8_0 and 8 of Q4_0) is applied per sub-block
against the sum of its activations, also prepared. Per weight that is one or two bitwise ops and
two FMAs (one more per extra slot); everything is elementwise in the weight tile's register layout,
and the sums over a row happen once, at the end. MXFP4's e2m1 codes (signed, no offset) are instead placed
in an fp16 by three integer ops (`_e2m1`).

Q4_K instead multiplies its codes with int8 activations (`INT8_TYPES`, `_k45_rows`): x is prepared as two int8
planes per block of 32, x ~= d * (q0 + q1 / 256) (the CPU kernels' form, `ops/csrc/quant.h`: one plane alone is
1/254 of the block's max, enough to move a later router's choice), and four codes at a time meet four activations in
one `dp4a` (integer dot of 4 bytes, accumulated), both planes in one int32 sum, 256 * (w . q0) + (w . q1). Per 8
weights that is 3 bitwise ops to take the nibbles apart and 4 dp4a per activation row, where the float path spends
about 4 instructions a weight. MXFP4 on int8 (`_e2m1_bytes`) looks its codes up as doubled e2m1 values (int8) in
byte permutes, 8 codes in 11 integer ops, against x's planes laid out in the codes' nibble order (`mxfp4_place`);
a block's words meet x in one chain of dp4a a plane. Planar MXFP4 (a resident bank, `ops.bank.to_planar`) reads a
block's 16 code bytes in one vector load: 2.9 instructions a weight at batch 1, against 8.4 on floats (sm90 counts,
`tools.sass_loops`).
"""

from __future__ import annotations

import os

import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]
from gguf import GGMLQuantizationType

from ops.bank import PLANAR_ROWS

QType = GGMLQuantizationType

Q4_K = tl.constexpr(int(QType.Q4_K))
Q5_K = tl.constexpr(int(QType.Q5_K))
Q6_K = tl.constexpr(int(QType.Q6_K))
Q8_0 = tl.constexpr(int(QType.Q8_0))
Q4_0 = tl.constexpr(int(QType.Q4_0))
MXFP4 = tl.constexpr(int(QType.MXFP4))
PLANAR_MXFP4 = 1000 + int(QType.MXFP4)  # the kernels' code of MXFP4 in `ops.bank.to_planar`'s order
MXFP4_PLANAR = tl.constexpr(PLANAR_MXFP4)
PLANAR = tl.constexpr(PLANAR_ROWS)  # rows a planar MXFP4 group holds
KERNEL_TYPES = (QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.Q4_0, QType.MXFP4)
GROUP = 16  # activation sums are kept per 16 columns (the smallest sub-block, Q6_K's)
MAGIC = 0x4B000000  # float32 bits of 2**23, passed to the kernels at run time (see _code_times)
INT8_CAPABLE = (QType.Q4_K, QType.Q5_K, QType.Q8_0, QType.Q4_0, QType.MXFP4)  # kernels on int8 activations


def _int8_types(value: str) -> tuple[QType, ...]:
    names = [name.strip() for name in value.split(",") if name.strip() not in ("", "0")]
    unknown = [name for name in names if name not in {t.name for t in INT8_CAPABLE}]
    if unknown:
        raise ValueError(f"MOECACHE_INT8_EXPERTS: {unknown} have no int8 kernel (formats: "
                         f"{[t.name for t in INT8_CAPABLE]})")
    return tuple(QType.__members__[name] for name in names)


# the formats whose kernels read x as two int8 planes (`prepare.prepare_block`): MOECACHE_INT8_EXPERTS names them
# (comma-separated; 0 or empty: none), read at import, to compare the paths; the default names those whose int8
# kernels the engine's rows were timed with (docs/kernels.md; Q5_K's has not been timed)
INT8_TYPES = _int8_types(os.environ.get("MOECACHE_INT8_EXPERTS", "Q4_K,MXFP4,Q4_0,Q8_0"))
Q4K_INT8 = tl.constexpr(QType.Q4_K in INT8_TYPES)
Q5K_INT8 = tl.constexpr(QType.Q5_K in INT8_TYPES)
Q80_INT8 = tl.constexpr(QType.Q8_0 in INT8_TYPES)
Q40_INT8 = tl.constexpr(QType.Q4_0 in INT8_TYPES)
MXFP4_INT8 = tl.constexpr(QType.MXFP4 in INT8_TYPES)
PLANE = tl.constexpr(256.0)  # plane 1's grid is 256 times finer than plane 0's
# the interpreter runs no inline PTX: dp4a is then the same sum in Triton's integer ops
EMULATE_DP4A = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def has_kernel(qtype: QType) -> bool:
    return qtype in KERNEL_TYPES


def kernel_format(qtype: QType, planar: bool) -> int:
    """The kernels' FMT of a matrix of `qtype` in a bank that is `planar` or not."""
    return PLANAR_MXFP4 if planar and qtype == QType.MXFP4 else int(qtype)


def reads_int8(qtype: QType | None) -> bool:
    """Whether the kernel of `qtype` reads x as two int8 planes (else as floats in `read_place`'s order)."""
    return qtype in INT8_TYPES


def steps_super_blocks(qtype: QType | None) -> bool:
    """Whether the kernel of `qtype` is a K-quant's on int8, stepping by whole super-blocks (`_k45_rows`)."""
    return reads_int8(qtype) and qtype in (QType.Q4_K, QType.Q5_K)


def step_blocks(num_cols: int, blocks: int = 0, qtype: QType | None = None) -> int:
    """Blocks of 32 columns a step of the 32-block formats' loops (`rows_dot`'s BLOCKS): `blocks` where given (a
    power of two), else the largest of 8, 4, 2, 1 that divides the row (the 32-block formats on int8, `qtype`: 8, the
    last step reading past the row as needed). Q4_K and Q5_K on int8 step by whole super-blocks that divide the row:
    the largest such multiple of 8 up to `blocks`."""
    if blocks:
        if blocks & (blocks - 1) or not 1 <= blocks <= 64:
            raise ValueError(f"blocks: expected a power of two in [1, 64], got {blocks}")
        while steps_super_blocks(qtype) and blocks > 8 and num_cols // 32 % blocks:
            blocks //= 2
        return blocks
    n = num_cols // 32
    if reads_int8(qtype) and not steps_super_blocks(qtype):  # 8 blocks, the last step's past the row weighted 0
        return min(8, triton.next_power_of_2(n))
    return (n | 8) & -(n | 8)


@triton.jit
def read_place(col, FMT: tl.constexpr):
    """Natural column indices -> (where the kernel of format FMT reads them, the factor 2**-e
    they are stored with). Any other FMT: unchanged, factor 1."""
    t = col % 256
    if FMT == Q4_K or FMT == Q5_K:
        # 64j + 32n + 4i + k -> 64k + 32n + 8j + i; nibble at bit e = 8k + 4n, or e - 12 above 16
        place = col - t + 64 * (t % 4) + 32 * ((t // 32) % 2) + 8 * (t // 64) + (t // 4) % 8
        e = 8 * (t % 4) + 4 * ((t // 32) % 2)
        e = tl.where(e > 16, e - 12, e)
    elif FMT == Q6_K:
        # 128h + 64nib + 32a + 16u + 2c + b -> 128nib + 64b + 32h + 16a + 8u + c; bit 8b + 4nib
        place = (col - t + 128 * ((t // 64) % 2) + 64 * (t % 2) + 32 * (t // 128) + 16 * ((t // 32) % 2)
                 + 8 * ((t // 16) % 2) + (t // 2) % 8)
        e = 8 * (t % 2) + 4 * ((t // 64) % 2)
    elif FMT == Q8_0:
        # 32c + 2m + b -> 32c + 16b + m; byte b at bit 8b
        u = col % 32
        place = col - u + 16 * (u % 2) + u // 2
        e = 8 * (u % 2)
    elif FMT == Q4_0:
        # 32c + 16n + 2m + b -> 32c + 16n + 8b + m; nibble n of byte b at bit 8b + 4n
        u = col % 32
        place = col - u + 16 * (u // 16) + 8 * (u % 2) + (u % 16) // 2
        e = 8 * (u % 2) + 4 * (u // 16)
    else:  # MXFP4 too: its kernel reads the natural order (the int8 formats read `prepare`'s planes instead)
        place = col
        e = col * 0
    return place, ((127 - e) << 23).to(tl.float32, bitcast=True)


# --- shared pieces -----------------------------------------------------------------------------------


@triton.jit
def _code_times(bits, magic, s, c):
    """int32 `bits` (a code times 2**e, below bit 23), magic = 0x4B000000 (the bits of 2**23; a run-time
    value, so that it stays in one register and each field mask is the bitwise op's immediate),
    s, c = -2**23 * s -> code * 2**e * s."""
    return tl.fma((bits | magic).to(tl.float32, bitcast=True), s, c)


@triton.jit
def _f16(w):
    """Low 16 bits of int32 words as an fp16 -> float32."""
    return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _slots(x0, x1, x2, x3, offsets, BT: tl.constexpr):
    """Prepared activations of the BT slots at `offsets` (the other slots repeat slot 0). Loads are 16
    bytes wide where Triton sees 16-byte aligned rows (row strides divisible by 16 elements)."""
    v0 = tl.load(x0 + offsets)
    v1, v2, v3 = v0, v0, v0
    if BT > 1:
        v1 = tl.load(x1 + offsets)
    if BT > 2:
        v2 = tl.load(x2 + offsets)
        v3 = tl.load(x3 + offsets)
    return v0, v1, v2, v3


@triton.jit
def _fma4(a0, a1, a2, a3, q, v0, v1, v2, v3, BT: tl.constexpr):
    a0 += q * v0
    if BT > 1:
        a1 += q * v1
    if BT > 2:
        a2 += q * v2
        a3 += q * v3
    return a0, a1, a2, a3


@triton.jit
def _total(a):
    """Elementwise accumulator (rank 2 to 4, rows on dim 1 at rank 4, else on dim 0) -> row sums `[BR]`."""
    if len(a.shape) == 4:
        total = tl.sum(tl.sum(tl.sum(a, axis=3), axis=2), axis=0)
    elif len(a.shape) == 3:
        total = tl.sum(tl.sum(a, axis=2), axis=1)
    else:
        total = tl.sum(a, axis=1)
    return total


@triton.jit
def _totals(a0, a1, a2, a3, m0, m1, m2, m3, BT: tl.constexpr):
    """Row sums of code terms minus offset terms, per slot."""
    r0 = _total(a0) - _total(m0)
    r1, r2, r3 = r0, r0, r0
    if BT > 1:
        r1 = _total(a1) - _total(m1)
    if BT > 2:
        r2 = _total(a2) - _total(m2)
        r3 = _total(a3) - _total(m3)
    return r0, r1, r2, r3


# --- Q4_K and Q5_K: 144 / 176-byte blocks of 256, fp16 d and dmin, 6-bit scales and mins -----------


@triton.jit
def _byte_field(lo, hi, shift, mask_lo, mask_hi):
    """(lo >> shift) & mask_lo | (hi >> (shift + 2)) & mask_hi as a float (values < 64)."""
    bits = ((lo >> shift) & mask_lo) | ((hi >> (shift + 2)) & mask_hi)
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _kquant_scales(blk, j, N: tl.constexpr):
    """d * scale and dmin * min of sub-blocks s = 2j + N; blk: int32 pointers to each block, shaped to broadcast
    with j (the result's shape). Scale bytes b[0..11] (words 1..3 of the block): s < 4: b[s] & 63, b[s + 4] & 63;
    else (b[s + 4] & 15) | (b[s - 4] >> 6) << 4, (b[s + 4] >> 4) | (b[s] >> 6) << 4."""
    head = tl.load(blk)  # fp16 d | dmin << 16
    w1 = tl.load(blk + 1)
    w2 = tl.load(blk + 2)
    w3 = tl.load(blk + 3)
    s = 2 * j + N
    is_low = s < 4
    shift = 8 * (s & 3)
    sc = _byte_field(tl.where(is_low, w1, w3), w1, shift, tl.where(is_low, 63, 15), tl.where(is_low, 0, 48))
    mn = _byte_field(tl.where(is_low, w2, w3 >> 4), w2, shift, tl.where(is_low, 63, 15), tl.where(is_low, 0, 48))
    return _f16(head) * sc, _f16(head >> 16) * mn


@triton.jit
def _kquant_bits(qs, fifth, E: tl.constexpr, N: tl.constexpr, FIFTH: tl.constexpr):
    """Code bits of the nibble at bit E = 8k + 4N of each qs word, moved to E - 12 if E > 16 (to stay
    inside the mantissa); for Q5_K with the fifth bit (bit 8k of `fifth`) above them."""
    SHIFT = 12 * (E > 16)
    bits = (qs >> SHIFT) & (15 << (E - SHIFT))
    if FIFTH:
        bits = bits | (((fifth >> SHIFT) << (4 * N + 4)) & (16 << (E - SHIFT)))
    return bits


@triton.jit
def _kquant_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic,
                 K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr, FIFTH: tl.constexpr):
    """Q4_K (FIFTH=False) or Q5_K rows; wa, wb: int32 pointers `[BR]` to each row's first word.
    Tile per super-block: qs words `[2 (ih), BR, 4 (j), 4 (il)]`, word 8j + 4ih + il; byte k of word i
    of chunk j holds weights 64j + 4i + k (low nibble, sub-block 2j) and 64j + 32 + 4i + k (high
    nibble, sub-block 2j + 1). ih on the slowest dim keeps a chunk's 8 words in one thread."""
    WORDS = 36 + 8 * FIFTH  # block size in words
    QS = 4 + 8 * FIFTH  # first qs word
    ih = tl.arange(0, 2)[:, None, None, None]
    j = tl.arange(0, 4)[None, None, :, None]
    il = tl.arange(0, 4)[None, None, None, :]
    word = 8 * j + 4 * ih + il
    zero = tl.zeros([2, wa.shape[0], 4, 4], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    mzero = tl.zeros([1, wa.shape[0], 4, 1], tl.float32)
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = mzero, mzero, mzero, mzero, mzero, mzero, mzero, mzero
    for sb in range(K // 256):
        ba = tl.multiple_of(wa + WORDS * sb, 16)
        bb = tl.multiple_of(wb + WORDS * sb, 16)
        qa = tl.load(ba[None, :, None, None] + QS + word)
        qb, qha, qhb = qa, qa, qa
        if TWO:
            qb = tl.load(bb[None, :, None, None] + QS + word)
        if FIFTH:  # qh word 4ih + il, the same for every chunk
            qha = tl.load(ba[None, :, None, None] + 4 + 4 * ih + il + 0 * j)
            if TWO:
                qhb = tl.load(bb[None, :, None, None] + 4 + 4 * ih + il + 0 * j)
        for n in tl.static_range(2):
            dsa, dma = _kquant_scales(ba[None, :, None, None], j, n)
            dsb, dmb = dsa, dma
            if TWO:
                dsb, dmb = _kquant_scales(bb[None, :, None, None], j, n)
            fa = qha >> (2 * j + n)  # bit 8k: the fifth bit of weight (j, n, i, k)
            fb = qhb >> (2 * j + n)
            for k in tl.static_range(4):
                v0, v1, v2, v3 = _slots(x0, x1, x2, x3, 256 * sb + 64 * k + 32 * n + word, BT)
                q = _code_times(_kquant_bits(qa, fa, 8 * k + 4 * n, n, FIFTH), magic, dsa, -8388608.0 * dsa)
                a0, a1, a2, a3 = _fma4(a0, a1, a2, a3, q, v0, v1, v2, v3, BT)
                if TWO:
                    q = _code_times(_kquant_bits(qb, fb, 8 * k + 4 * n, n, FIFTH), magic, dsb, -8388608.0 * dsb)
                    b0, b1, b2, b3 = _fma4(b0, b1, b2, b3, q, v0, v1, v2, v3, BT)
            # sums of the sub-block's 32 activations: two groups of 16
            group = 16 * sb + 4 * j + 2 * n
            v0, v1, v2, v3 = _slots(s0, s1, s2, s3, group, BT)
            u0, u1, u2, u3 = _slots(s0, s1, s2, s3, group + 1, BT)
            ma0, ma1, ma2, ma3 = _fma4(ma0, ma1, ma2, ma3, dma, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
            if TWO:
                mb0, mb1, mb2, mb3 = _fma4(mb0, mb1, mb2, mb3, dmb, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3


# --- Q4_K on int8 activations: 144-byte blocks of 256, fp16 d and dmin, 6-bit scales and mins ------------------


@triton.jit
def dp4a(a, b, c, SIGNED: tl.constexpr = False):
    """int32 c + the dot of a's 4 unsigned bytes (SIGNED: signed) with b's 4 signed bytes (elementwise over int32
    tensors)."""
    if EMULATE_DP4A:
        for k in tl.static_range(4):
            if SIGNED:
                c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
            else:
                c += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return c
    elif SIGNED:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _quarters(t):
    """`[BR, SBS, 4, 8]` -> its words 4h + k for k = 0, 1, 2, 3, each `[BR, SBS, 4, 2 (h)]` (a thread holds 4
    consecutive words of a load: the splits stay in its registers)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 4, 2, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _k4_isum(codes, p0, p1):
    """Per sub-block: 256 * (codes . plane 0) + codes . plane 1 over the 8 words of each `[.., 8]` row, as chains of
    dp4a (one shift per chain of 4 words, no adds)."""
    c0, c1, c2, c3 = _quarters(codes)
    x0, x1, x2, x3 = _quarters(p0)
    y0, y1, y2, y3 = _quarters(p1)
    total = dp4a(c3, x3, dp4a(c2, x2, dp4a(c1, x1, dp4a(c0, x0, tl.zeros_like(c0)))))
    total = dp4a(c3, y3, dp4a(c2, y2, dp4a(c1, y1, dp4a(c0, y0, total << 8))))
    return tl.sum(total, axis=3)


@triton.jit
def _k4_slot(x, s, words, block, group, K: tl.constexpr):
    """One activation row's int8 planes at `words` (low nibbles) and words + 8 (high), its d per 32 of sub-blocks
    `block` and block + 1, and the sums of sub-blocks from group 16s `group`: (plane words lo0, hi0, lo1, hi1,
    d lo, d hi, sum lo, sum hi)."""
    xw = x.to(tl.pointer_type(tl.int32), bitcast=True)
    lo0 = tl.load(xw + words)
    hi0 = tl.load(xw + words + 8)
    lo1 = tl.load(xw + K // 4 + words)
    hi1 = tl.load(xw + K // 4 + words + 8)
    dlo = tl.load(x + K // 2 + block)
    dhi = tl.load(x + K // 2 + block + 1)
    slo = tl.load(s + group) + tl.load(s + group + 1)
    shi = tl.load(s + group + 2) + tl.load(s + group + 3)
    return lo0, hi0, lo1, hi1, dlo, dhi, slo, shi


@triton.jit
def _k4_acc(acc, macc, lo, hi, dsl, dsh, dml, dmh, lo0, hi0, lo1, hi1, dlo, dhi, slo, shi):
    """The code terms (acc) and min terms (macc) of one matrix and one activation row."""
    acc += _k4_isum(lo, lo0, lo1).to(tl.float32) * (dsl * dlo) + _k4_isum(hi, hi0, hi1).to(tl.float32) * (dsh * dhi)
    macc += dml * slo + dmh * shi
    return acc, macc


@triton.jit
def _k45_codes(blk, j, i, FIFTH: tl.constexpr):
    """The codes of chunks j `[BR, SBS, 4, 8]` words of super-blocks `blk` (int32 pointers `[BR, SBS, 1]`): the low
    nibbles' (sub-block 2j) and the high nibbles' (2j + 1), a byte each, with Q5_K's fifth bits (FIFTH)."""
    j = j[:, :, :, None]
    q = tl.load(blk[:, :, :, None] + 4 + 8 * FIFTH + 8 * j + i)
    lo, hi = q & 0x0F0F0F0F, (q >> 4) & 0x0F0F0F0F
    if FIFTH:  # qh word i holds the fifth bits of weights 4i .. 4i + 3 of every sub-block
        qh = tl.load(blk[:, :, :, None] + 4 + i + 0 * j)
        lo = lo | (((qh >> (2 * j)) & 0x01010101) << 4)
        hi = hi | (((qh >> (2 * j + 1)) & 0x01010101) << 4)
    return lo, hi


@triton.jit
def _k4_accs(a0, a1, a2, a3, m0, m1, m2, m3, lo, hi, dsl, dsh, dml, dmh, x0, x1, x2, x3, s0, s1, s2, s3,
             words, block, group, K: tl.constexpr, BT: tl.constexpr):
    """`_k4_acc` over the BT activation rows."""
    v = _k4_slot(x0, s0, words, block, group, K)
    a0, m0 = _k4_acc(a0, m0, lo, hi, dsl, dsh, dml, dmh, *v)
    if BT > 1:
        v = _k4_slot(x1, s1, words, block, group, K)
        a1, m1 = _k4_acc(a1, m1, lo, hi, dsl, dsh, dml, dmh, *v)
    if BT > 2:
        v = _k4_slot(x2, s2, words, block, group, K)
        a2, m2 = _k4_acc(a2, m2, lo, hi, dsl, dsh, dml, dmh, *v)
        v = _k4_slot(x3, s3, words, block, group, K)
        a3, m3 = _k4_acc(a3, m3, lo, hi, dsl, dsh, dml, dmh, *v)
    return a0, a1, a2, a3, m0, m1, m2, m3


@triton.jit
def _k45_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr,
              SBS: tl.constexpr, FIFTH: tl.constexpr):
    """Q4_K (144-byte blocks) or Q5_K (FIFTH: 176 bytes, 32 bytes of fifth bits before the nibbles: bit s of byte b
    is bit 4 of weight b of sub-block s) rows on int8 activations (`INT8_TYPES`); wa, wb: int32 pointers `[BR]` to
    each row's first word; x0..x3
    rows prepared as two planes (`prepare.prepare_block`), s0..s3 the sums per 16 of their values. Tile per step:
    qs words `[BR, SBS super-blocks, 4 (j), 8 (i)]`; byte k of word 8j + i holds the codes of weights 64j + 4i + k
    (low nibble, sub-block 2j) and 64j + 32 + 4i + k (high nibble, sub-block 2j + 1): the natural order of x's int8
    words 16j + i and 16j + 8 + i. Scales and sums are `[BR, SBS, 4]`, one per (super-block, j)."""
    sbs = tl.arange(0, SBS)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    i = tl.arange(0, 8)[None, None, None, :]
    zero = tl.zeros([wa.shape[0], SBS, 4], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = zero, zero, zero, zero, zero, zero, zero, zero
    WORDS: tl.constexpr = 44 if FIFTH else 36  # a block's words
    tl.static_assert(K // 256 % SBS == 0, "Q4_K/Q5_K: the super-blocks a step must divide the row's")
    for step in range(K // 256 // SBS):
        sb = step * SBS + sbs
        # NOTE: the hint on each step's row pointers (`[BR]`) is what makes the weight loads 16 bytes wide
        ba = tl.multiple_of(wa + WORDS * SBS * step, 16)[:, None, None] + WORDS * sbs
        bb = tl.multiple_of(wb + WORDS * SBS * step, 16)[:, None, None] + WORDS * sbs
        la, ha = _k45_codes(ba, j, i, FIFTH)
        lb, hb = la, ha
        if TWO:
            lb, hb = _k45_codes(bb, j, i, FIFTH)
        # x's words for every row: loads of the weights' shape take the weights' layout (16-byte loads; the
        # rows' equal addresses are one load)
        words = tl.zeros([wa.shape[0], SBS, 4, 8], tl.int32) + (64 * sb + 16 * j)[:, :, :, None] + i
        block = 8 * sb + 2 * j
        group = 16 * sb + 4 * j
        dsl, dml = _kquant_scales(ba, j, 0)  # the code terms' scales / 256: the planes' sum is 256 plane 0's
        dsh, dmh = _kquant_scales(ba, j, 1)
        dsl, dsh = dsl * (1.0 / PLANE), dsh * (1.0 / PLANE)
        a0, a1, a2, a3, ma0, ma1, ma2, ma3 = _k4_accs(
            a0, a1, a2, a3, ma0, ma1, ma2, ma3, la, ha, dsl, dsh, dml, dmh,
            x0, x1, x2, x3, s0, s1, s2, s3, words, block, group, K, BT)
        if TWO:
            dsl, dml = _kquant_scales(bb, j, 0)
            dsh, dmh = _kquant_scales(bb, j, 1)
            dsl, dsh = dsl * (1.0 / PLANE), dsh * (1.0 / PLANE)
            b0, b1, b2, b3, mb0, mb1, mb2, mb3 = _k4_accs(
                b0, b1, b2, b3, mb0, mb1, mb2, mb3, lb, hb, dsl, dsh, dml, dmh,
                x0, x1, x2, x3, s0, s1, s2, s3, words, block, group, K, BT)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3

# --- Q6_K: 210-byte blocks (2-byte aligned), read as 16-bit halves -------------------------------------


@triton.jit
def _q6k_load(blk, m, c):
    """ql `[BR, 8, 8]` and qh (moved, see below) of one super-block; blk: int16 pointers `[BR]`."""
    ql = tl.load(blk[:, None, None] + 8 * m + c).to(tl.int32)
    qh = tl.load(blk[:, None, None] + 64 + 16 * (m // 4) + 8 * (m % 2) + c).to(tl.int32)
    # the 2 high bits of (a, byte b) sit at bit 8b + 2a + 4nib of the qh half; move them to 8b + 4nib + 4
    return ql, qh << (4 - 2 * ((m // 2) % 2))


@triton.jit
def _q6k_scales(blk, m, c, NIB: tl.constexpr):
    """d * scale `[BR, 8, 8]` (the same along c) of the sub-blocks 8h + 2a + 4NIB + u of tile rows m."""
    d = _f16(tl.load(blk + 104).to(tl.int32))[:, None, None]
    sub = 8 * (m // 4) + 2 * ((m // 2) % 2) + 4 * NIB + (m % 2) + 0 * c
    scales = blk.to(tl.pointer_type(tl.int8), bitcast=True)[:, None, None] + 192 + sub
    # no contiguity along m: the load then takes the ql tile's layout (c fastest)
    scales = tl.max_contiguous(scales, [1, 1, 1])
    sc = tl.load(scales).to(tl.int32)
    # int8 -> float: (byte ^ 0x80) is the code + 128
    return d * ((((sc ^ 0x80) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0), sub


@triton.jit
def _q6k_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic,
              K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr):
    """Q6_K rows; wa, wb: int16 pointers `[BR]` to each row. Per super-block (105 halves): ql halves
    0..63, qh 64..95, int8 scales at bytes 192..207, fp16 d at half 104. Tile `[BR, 8 (m), 8 (c)]`
    over ql half 8m + c with m = 4h + 2a + u: byte b holds weights 128h + 32a + 16u + 2c + b (low
    nibble) and the same + 64 (high nibble); w = d * scale * (q - 32) per 16 weights."""
    m = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    zero = tl.zeros([wa.shape[0], 8, 8], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = zero, zero, zero, zero, zero, zero, zero, zero
    for sb in range(K // 256):
        ba = wa + 105 * sb
        bb = wb + 105 * sb
        qla, qha = _q6k_load(ba, m, c)
        qlb, qhb = qla, qha
        if TWO:
            qlb, qhb = _q6k_load(bb, m, c)
        for nib in tl.static_range(2):
            dsa, sub = _q6k_scales(ba, m, c, nib)
            dsb = dsa
            if TWO:
                dsb, sub = _q6k_scales(bb, m, c, nib)
            for b in tl.static_range(2):
                E = 8 * b + 4 * nib
                v0, v1, v2, v3 = _slots(x0, x1, x2, x3,
                                        256 * sb + 128 * nib + 64 * b + 8 * m + c, BT)
                q = _code_times((qla & (15 << E)) | (qha & (48 << E)), magic, dsa, -8388608.0 * dsa)
                a0, a1, a2, a3 = _fma4(a0, a1, a2, a3, q, v0, v1, v2, v3, BT)
                if TWO:
                    q = _code_times((qlb & (15 << E)) | (qhb & (48 << E)), magic, dsb, -8388608.0 * dsb)
                    b0, b1, b2, b3 = _fma4(b0, b1, b2, b3, q, v0, v1, v2, v3, BT)
            # code bias 32 per sub-block, counted once per sub-block: 1/8 on each of its 8 c
            v0, v1, v2, v3 = _slots(s0, s1, s2, s3, 16 * sb + sub + 0 * m, BT)
            ma0, ma1, ma2, ma3 = _fma4(ma0, ma1, ma2, ma3, 4.0 * dsa, v0, v1, v2, v3, BT)
            if TWO:
                mb0, mb1, mb2, mb3 = _fma4(mb0, mb1, mb2, mb3, 4.0 * dsb, v0, v1, v2, v3, BT)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3


# --- Q8_0: 34-byte blocks of 32 int8 (2-byte aligned), read as halves, NB blocks at a time ----------


@triton.jit
def _blocks(g, NBLK: tl.constexpr, NB: tl.constexpr):
    """Step g's NB block indices `[1, NB, 1]` of a row of NBLK blocks, those past the row clamped to its last block
    (read, then weighted 0 by the caller), and which are in the row."""
    c = NB * g + tl.arange(0, NB)[None, :, None]
    return tl.minimum(c, NBLK - 1), c < NBLK


@triton.jit
def _q80_load(start, c, m):
    """Halves `[BR, NB, 16]` (half 1 + m of block c: weights 2m, 2m + 1) and d (the same along m)."""
    halves = tl.load(start[:, None, None] + 17 * c + 1 + m).to(tl.int32)
    d = _f16(tl.load(start[:, None, None] + 17 * c + 0 * m).to(tl.int32))
    return halves, d


@triton.jit
def _q80_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic,
              K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr, NB: tl.constexpr):
    """Q8_0 rows; wa, wb: int16 pointers `[BR]` to each row. Tile `[BR, NB blocks, 16 halves]`;
    byte b of half 1 + m of block c, xor 0x80, is the int8 code of weight 32c + 2m + b, plus 128."""
    m = tl.arange(0, 16)[None, None, :]
    zero = tl.zeros([wa.shape[0], NB, 16], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = zero, zero, zero, zero, zero, zero, zero, zero
    for g in range((K // 32 + NB - 1) // NB):
        c, valid = _blocks(g, K // 32, NB)
        qa, da = _q80_load(wa, c, m)
        qb, db = qa, da
        if TWO:
            qb, db = _q80_load(wb, c, m)
        if K // 32 % NB:  # the last step's blocks past the row: their scales 0, so they add nothing
            da, db = tl.where(valid, da, 0.0), tl.where(valid, db, 0.0)
        for b in tl.static_range(2):
            v0, v1, v2, v3 = _slots(x0, x1, x2, x3, 32 * c + 16 * b + m, BT)
            q = _code_times((qa ^ (128 << (8 * b))) & (255 << (8 * b)), magic, da, -8388608.0 * da)
            a0, a1, a2, a3 = _fma4(a0, a1, a2, a3, q, v0, v1, v2, v3, BT)
            if TWO:
                q = _code_times((qb ^ (128 << (8 * b))) & (255 << (8 * b)), magic, db, -8388608.0 * db)
                b0, b1, b2, b3 = _fma4(b0, b1, b2, b3, q, v0, v1, v2, v3, BT)
        # code bias 128 per block, counted once per block: 1/16 on each of its 16 halves
        v0, v1, v2, v3 = _slots(s0, s1, s2, s3, 2 * c + 0 * m, BT)
        u0, u1, u2, u3 = _slots(s0, s1, s2, s3, 2 * c + 1 + 0 * m, BT)
        ma0, ma1, ma2, ma3 = _fma4(ma0, ma1, ma2, ma3, 8.0 * da, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
        if TWO:
            mb0, mb1, mb2, mb3 = _fma4(mb0, mb1, mb2, mb3, 8.0 * db, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3


# --- Q4_0: 18-byte blocks of 32 (2-byte aligned), read as halves, NB blocks at a time -----------------------


@triton.jit
def _q40_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic,
              K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr, NB: tl.constexpr):
    """Q4_0 rows; wa, wb: int16 pointers `[BR]` to each row. Tile `[BR, NB blocks, 8 halves]`; byte b of half 1 + m
    of block c holds weights 32c + 2m + b (low nibble) and 32c + 16 + 2m + b (high); w = d * (q - 8)."""
    m = tl.arange(0, 8)[None, None, :]
    zero = tl.zeros([wa.shape[0], NB, 8], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = zero, zero, zero, zero, zero, zero, zero, zero
    for g in range((K // 32 + NB - 1) // NB):
        c, valid = _blocks(g, K // 32, NB)
        qa = tl.load(wa[:, None, None] + 9 * c + 1 + m).to(tl.int32)
        da = _f16(tl.load(wa[:, None, None] + 9 * c + 0 * m).to(tl.int32))
        qb, db = qa, da
        if TWO:
            qb = tl.load(wb[:, None, None] + 9 * c + 1 + m).to(tl.int32)
            db = _f16(tl.load(wb[:, None, None] + 9 * c + 0 * m).to(tl.int32))
        if K // 32 % NB:  # the last step's blocks past the row: their scales 0, so they add nothing
            da, db = tl.where(valid, da, 0.0), tl.where(valid, db, 0.0)
        for n in tl.static_range(2):
            for b in tl.static_range(2):
                E = 8 * b + 4 * n
                v0, v1, v2, v3 = _slots(x0, x1, x2, x3, 32 * c + 16 * n + 8 * b + m, BT)
                q = _code_times(qa & (15 << E), magic, da, -8388608.0 * da)
                a0, a1, a2, a3 = _fma4(a0, a1, a2, a3, q, v0, v1, v2, v3, BT)
                if TWO:
                    q = _code_times(qb & (15 << E), magic, db, -8388608.0 * db)
                    b0, b1, b2, b3 = _fma4(b0, b1, b2, b3, q, v0, v1, v2, v3, BT)
        # code bias 8 per block, counted once per block: 1/8 on each of its 8 halves
        v0, v1, v2, v3 = _slots(s0, s1, s2, s3, 2 * c + 0 * m, BT)
        u0, u1, u2, u3 = _slots(s0, s1, s2, s3, 2 * c + 1 + 0 * m, BT)
        ma0, ma1, ma2, ma3 = _fma4(ma0, ma1, ma2, ma3, da, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
        if TWO:
            mb0, mb1, mb2, mb3 = _fma4(mb0, mb1, mb2, mb3, db, v0 + u0, v1 + u1, v2 + u2, v3 + u3, BT)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3


# --- Q8_0 and Q4_0 on int8 activations: 2-byte aligned blocks of 32, words put together from halves -------------


@triton.jit
def _block_words(start, c, i, HALVES: tl.constexpr):
    """Words i `[BR, NB, W]` of the codes of blocks c (`[1, NB, 1]`) of rows `start` (int16 pointers `[BR]`, blocks
    of HALVES halves, the fp16 d first): halves 1 + 2i and 2 + 2i put together."""
    low = tl.load(start[:, None, None] + HALVES * c + 1 + 2 * i).to(tl.int32) & 0xFFFF
    return low | (tl.load(start[:, None, None] + HALVES * c + 2 + 2 * i).to(tl.int32) << 16)


@triton.jit
def _b32_slot(x, s, c, i, K: tl.constexpr, W: tl.constexpr):
    """One activation row's int8 plane words for blocks c: words 8c + i (W = 8: the block's 32 columns; W = 4: its
    first 16, then words 8c + 4 + i its last 16), its d per 32 and its block sums."""
    xw = x.to(tl.pointer_type(tl.int32), bitcast=True)
    words = 8 * c + i
    lo0, lo1 = tl.load(xw + words), tl.load(xw + K // 4 + words)
    hi0, hi1 = lo0, lo1
    if W == 4:
        hi0, hi1 = tl.load(xw + words + 4), tl.load(xw + K // 4 + words + 4)
    block = tl.sum(c, axis=2)  # [1, NB]
    return lo0, lo1, hi0, hi1, tl.load(x + K // 2 + block), tl.load(s + 2 * block) + tl.load(s + 2 * block + 1)


@triton.jit
def prmt(a, b, c):
    """Bytes of int32 words (a, b) picked by the low 3 bits of c's four low nibbles (PTX `prmt.b32`; every selector
    below is under 8, so no byte's sign is replicated)."""
    if EMULATE_DP4A:
        out = c * 0
        for n in tl.static_range(4):
            index = (c >> (4 * n)) & 7
            byte = tl.where(index < 4, a >> (8 * (index & 3)), b >> (8 * (index & 3))) & 0xFF
            out = out | (byte << (8 * n))
        return out
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _e2m1_bytes(w):
    """MXFP4's codes in int32 words `w` (byte j: low nibble weight j, high nibble weight 16 + j of its 4) -> the
    doubled e2m1 values as int8 (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) in the codes' nibble order: the
    first word weights j, 16 + j, j + 1, 17 + j, the second j + 2, 18 + j, j + 3, 19 + j (x's planes hold MXFP4's
    columns in that order, `mxfp4_place`): a table lookup in byte permutes."""
    zero = w * 0
    t0, t1 = zero + 0x03020100, zero + 0x0C080604  # 0 1 2 3 | 4 6 8 12
    t2, t3 = zero - 0x020100FF - 1, zero - 0x0B070503 - 1  # 0 -1 -2 -3 | -4 -6 -8 -12 (0xFDFEFF00, 0xF4F8FAFC)
    magnitude = w & 0x77777777
    signs = 0x32103210 | ((w >> 1) & 0x44444444)  # a code's sign bit picks the table's negative half
    low = prmt(prmt(t0, t1, magnitude), prmt(t2, t3, magnitude), signs)
    high = prmt(prmt(t0, t1, magnitude >> 16), prmt(t2, t3, magnitude >> 16), signs >> 16)
    return low, high


@triton.jit
def mxfp4_place(col):
    """Where column `col` of x sits in its int8 planes for MXFP4 (`_e2m1_bytes`' order), within its block of 32:
    word i of the block's first 16 columns holds columns 4i, 16 + 4i, 4i + 1, 17 + 4i, word i of the last 16
    columns 4i + 2, 18 + 4i, 4i + 3, 19 + 4i."""
    t = col % 32
    u = t % 16
    return col - t + 4 * (u // 4 + 4 * ((u % 4) // 2)) + 2 * (u % 2) + t // 16


@triton.jit
def _b32_acc(acc, macc, lo, hi, ds, dm, lo0, lo1, hi0, hi1, dx, xs, KIND: tl.constexpr):
    """A matrix's block terms for one activation row: acc += (256 (w . q0) + w . q1) ds dx per block (ds: the
    weights' scale / 256); Q4_0 (KIND 1) also macc += dm * the block's sum. Codes: Q8_0 (KIND 0) lo, signed, against
    x's words lo0 / lo1; Q4_0 (unsigned) and MXFP4 (2, signed) lo and hi against lo0 / lo1 and hi0 / hi1."""
    if KIND == 0:
        total = tl.sum(dp4a(lo, lo1, dp4a(lo, lo0, tl.zeros_like(lo), True) << 8, True), axis=2)
    else:  # a block's 4 words of each plane in one chain of dp4a: no adds, one shift a block
        plane0 = _chain(lo, lo0, _chain(hi, hi0, tl.zeros_like(ds).to(tl.int32), KIND == 2), KIND == 2)
        plane1 = _chain(lo, lo1, _chain(hi, hi1, tl.zeros_like(ds).to(tl.int32), KIND == 2), KIND == 2)
        total = (plane0 << 8) + plane1
    if KIND == 1:
        macc += dm * xs
    acc += total.to(tl.float32) * (ds * dx)
    return acc, macc


@triton.jit
def _chain(w, x, acc, SIGNED: tl.constexpr):
    """acc `[BR, NB]` + the dot of each block's 4 code words w with x's 4 words `[BR, NB, 4]`: 4 chained dp4a."""
    w0, w1, w2, w3 = _words(w)
    x0, x1, x2, x3 = _words(x)
    return dp4a(w3, x3, dp4a(w2, x2, dp4a(w1, x1, dp4a(w0, x0, acc, SIGNED), SIGNED), SIGNED), SIGNED)


@triton.jit
def _words(t):
    """`[BR, NB, 4]` -> its 4 words along the last axis, each `[BR, NB]` (a thread holds a block's 4 words, loaded
    together: the splits stay in its registers)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _b32_words(start, scales, c, valid, i, KIND: tl.constexpr, PLANAR: tl.constexpr):
    """The code words `[BR, NB, W]` of blocks c of rows `start` (int16 pointers, bytes for MXFP4) as (lo, hi), and the
    blocks' scale / 256 (the scale MXFP4's doubled values take) `[BR, NB]`, 0 for blocks past the row. PLANAR
    (MXFP4 in `ops.bank.to_planar`'s order): start points at each row's codes (16-byte aligned), scales at its
    scale bytes."""
    is_in = tl.sum(valid.to(tl.int32), axis=2) > 0
    block = tl.sum(c, axis=2)  # [1, NB]
    if KIND == 2 and PLANAR:  # a block's 16 code bytes are 4 aligned words: one vector load
        word = tl.load(start.to(tl.pointer_type(tl.int32))[:, None, None] + 4 * c + i)
        lo, hi = _e2m1_bytes(word)
        scale = _e8m0_scale(tl.load(scales[:, None] + block).to(tl.int32)) * (1.0 / 8388608.0)  # 2**-15 / 256
    elif KIND == 2:  # 17-byte blocks: a word is put together from 4 byte loads of the tile's shape
        first = start[:, None, None] + 17 * c + 1 + 4 * i
        word = tl.load(first).to(tl.int32)
        for k in tl.static_range(1, 4):
            word = word | (tl.load(first + k).to(tl.int32) << (8 * k))
        lo, hi = _e2m1_bytes(word)
        scale = _e8m0_scale(tl.load(start[:, None] + 17 * block).to(tl.int32)) * (1.0 / 8388608.0)  # 2**-15 / 256
    else:
        halves = 9 if KIND == 1 else 17
        lo = _block_words(start, c, i, halves)
        hi = lo
        if KIND == 1:
            lo, hi = lo & 0x0F0F0F0F, (lo >> 4) & 0x0F0F0F0F
        scale = _f16(tl.load(start[:, None] + halves * block).to(tl.int32)) * (1.0 / PLANE)
    return lo, hi, tl.where(is_in, scale, 0.0)


@triton.jit
def _b32_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr,
              NB: tl.constexpr, KIND: tl.constexpr, sa, sb, PLANAR: tl.constexpr):
    """Rows of blocks of 32 on int8 activations: Q8_0 (KIND 0; 34-byte blocks of int8 codes, w = d q), Q4_0 (1;
    18-byte blocks, byte j's low nibble weight j and high nibble weight 16 + j, w = d (q - 8)) or MXFP4 (2; 17-byte
    blocks, an e8m0 scale then Q4_0's nibble order of e2m1 codes); wa, wb: int16 pointers `[BR]` to each row (byte
    pointers for MXFP4; PLANAR: `_planar_rows`' pointers to the rows' codes, and sa, sb to their scales). Tile
    `[BR, NB blocks, W words]` (W = 8 for Q8_0, else 4), NB blocks a step (`_blocks`)."""
    W: tl.constexpr = 8 if KIND == 0 else 4
    i = tl.zeros([wa.shape[0], NB, W], tl.int32) + tl.arange(0, W)[None, None, :]  # the weights' shape for x too
    zero = tl.zeros([wa.shape[0], NB], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3 = zero, zero, zero, zero, zero, zero, zero, zero
    for g in range((K // 32 + NB - 1) // NB):
        c, valid = _blocks(g, K // 32, NB)
        la, ha, da = _b32_words(wa, sa, c, valid, i, KIND, PLANAR)
        lb, hb, db = la, ha, da
        if TWO:
            lb, hb, db = _b32_words(wb, sb, c, valid, i, KIND, PLANAR)
        v = _b32_slot(x0, s0, c, i, K, W)
        a0, ma0 = _b32_acc(a0, ma0, la, ha, da, 2048.0 * da, *v, KIND)
        if TWO:
            b0, mb0 = _b32_acc(b0, mb0, lb, hb, db, 2048.0 * db, *v, KIND)
        if BT > 1:
            v = _b32_slot(x1, s1, c, i, K, W)
            a1, ma1 = _b32_acc(a1, ma1, la, ha, da, 2048.0 * da, *v, KIND)
            if TWO:
                b1, mb1 = _b32_acc(b1, mb1, lb, hb, db, 2048.0 * db, *v, KIND)
        if BT > 2:
            v = _b32_slot(x2, s2, c, i, K, W)
            a2, ma2 = _b32_acc(a2, ma2, la, ha, da, 2048.0 * da, *v, KIND)
            if TWO:
                b2, mb2 = _b32_acc(b2, mb2, lb, hb, db, 2048.0 * db, *v, KIND)
            v = _b32_slot(x3, s3, c, i, K, W)
            a3, ma3 = _b32_acc(a3, ma3, la, ha, da, 2048.0 * da, *v, KIND)
            if TWO:
                b3, mb3 = _b32_acc(b3, mb3, lb, hb, db, 2048.0 * db, *v, KIND)
    a0, a1, a2, a3 = _totals(a0, a1, a2, a3, ma0, ma1, ma2, ma3, BT)
    b0, b1, b2, b3 = _totals(b0, b1, b2, b3, mb0, mb1, mb2, mb3, BT)
    return a0, a1, a2, a3, b0, b1, b2, b3


# --- MXFP4: 17-byte blocks of 32 (byte aligned): an e8m0 scale, 16 bytes of e2m1 codes ------------------


@triton.jit
def _mxfp4_load(codes, scales, c, g, j, K: tl.constexpr, NB: tl.constexpr, PLANAR: tl.constexpr):
    """Code bytes `[BR, NB, 16]` (byte j of block c: weights 32c + j, low nibble, and 32c + 16 + j) and the blocks'
    scales as `_e8m0_scale` gives them, `[BR, NB, 16]` or `[BR, NB, 1]`. codes: byte pointers `[BR]` to each row;
    PLANAR (`_planar_rows`): to each row's codes, 16 bytes a block, and scales to its scale bytes."""
    if PLANAR:
        blocks = tl.minimum(NB * g + tl.arange(0, NB), K // 32 - 1)[None, :]
        q = tl.load(codes[:, None, None] + 16 * c + j)
        scale = tl.expand_dims(_e8m0_scale(tl.load(scales[:, None] + blocks).to(tl.int32)), 2)
    else:
        q = tl.load(codes[:, None, None] + 17 * c + 1 + j)
        scale = _e8m0_scale(tl.load(codes[:, None, None] + 17 * c + 0 * j).to(tl.int32))
    return q.to(tl.int32), scale


@triton.jit
def _e8m0_scale(e):
    """An e8m0 scale byte (int32) -> 2**(e - 113): the block's 2**(e - 127) times the 2**14 that `_e2m1` leaves out
    (a normal float for every e up to 240; ggml's e8m0 half, 2**(e - 128), goes with its doubled codes)."""
    return ((e + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code, SHIFT: tl.constexpr):
    """The e2m1 code at bit SHIFT of int32 `code` times 2**-14, exact: its two exponent bits and its mantissa bit
    become an fp16's lowest exponent bits and top mantissa bit (an fp16 subnormal holds the code 0.5), its sign bit the
    fp16's sign; three integer ops and the fp16's conversion, no table."""
    half = ((code << (9 - SHIFT)) & 0x0E00) | ((code << (12 - SHIFT)) & 0x8000)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp4_rows(ca, sa, cb, sb, x0, x1, x2, x3, K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr,
                NB: tl.constexpr, PLANAR: tl.constexpr):
    """MXFP4 rows of matrices a and b (`_mxfp4_load`'s pointers: ca, cb to the rows, or PLANAR their codes and sa, sb
    their scales). Tile `[BR, NB blocks, 16 bytes]`; no code offset. Planar: a block's 16 code bytes in one vector
    load, its scale byte once."""
    j = tl.max_contiguous(tl.arange(0, 16), 16)[None, None, :]
    zero = tl.zeros([ca.shape[0], NB, 16], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    for g in range((K // 32 + NB - 1) // NB):
        c, valid = _blocks(g, K // 32, NB)
        qa, da = _mxfp4_load(ca, sa, c, g, j, K, NB, PLANAR)
        qb, db = qa, da
        if TWO:
            qb, db = _mxfp4_load(cb, sb, c, g, j, K, NB, PLANAR)
        if K // 32 % NB:  # the last step's blocks past the row: their scales 0, so they add nothing
            da, db = tl.where(valid, da, 0.0), tl.where(valid, db, 0.0)
        for n in tl.static_range(2):
            v0, v1, v2, v3 = _slots(x0, x1, x2, x3, 32 * c + 16 * n + j, BT)
            a0, a1, a2, a3 = _fma4(a0, a1, a2, a3, _e2m1(qa, 4 * n) * da, v0, v1, v2, v3, BT)
            if TWO:
                b0, b1, b2, b3 = _fma4(b0, b1, b2, b3, _e2m1(qb, 4 * n) * db, v0, v1, v2, v3, BT)
    return _total(a0), _total(a1), _total(a2), _total(a3), _total(b0), _total(b1), _total(b2), _total(b3)


@triton.jit
def planar_offsets(rows, row_bytes, cols):
    """Byte offsets of rows `rows` of a planar MXFP4 matrix of `cols` columns (`ops.bank.to_planar`: groups of
    PLANAR rows, their codes, cols / 2 bytes a row, then their scales, cols / 32 bytes a row): each row's codes
    (16-byte aligned) and its scales."""
    group = (rows // PLANAR) * (PLANAR * row_bytes)
    return group + (rows % PLANAR) * (cols // 2), group + PLANAR * (cols // 2) + (rows % PLANAR) * (cols // 32)


@triton.jit
def _planar_rows(addr, rows, row_bytes, K: tl.constexpr):
    """Rows of a planar MXFP4 matrix at byte address addr: pointers `[BR]` to each row's code bytes and to its scale
    bytes (`planar_offsets`)."""
    base = addr.to(tl.pointer_type(tl.uint8))
    codes, scales = planar_offsets(rows, row_bytes, K)
    return tl.multiple_of(base + codes, 16), base + scales


# --- one row block of any format --------------------------------------------------------------------


@triton.jit
def rows_dot(addr_a, addr_b, rows, row_bytes, x0, x1, x2, x3, s0, s1, s2, s3, magic,
             FMT: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr, BLOCKS: tl.constexpr):
    """Dots of rows `rows` (`[BR]`, all in range) of the matrices at byte addresses addr_a and, if TWO,
    addr_b (int64, 16-byte aligned, rows of row_bytes, format FMT, K columns) with activation rows
    x0..x3 (pointers to rows prepared for FMT; BT slots used) and their sums per 16 columns s0..s3
    (pointers); magic = 0x4B000000. Nothing is masked: callers clamp rows and point empty slots at a valid row.
    FMT: `kernel_format`'s (MXFP4_PLANAR: MXFP4 in `ops.bank.to_planar`'s order).
    BLOCKS (Q8_0, Q4_0, MXFP4; Q4_K reads BLOCKS / 8 super-blocks a step, at least one; Q5_K and Q6_K one): blocks
    of 32 a step, a power of two (`step_blocks`); a row that BLOCKS does not divide ends in a step whose blocks past
    the row are read and weighted 0. x0..x3 of an `INT8_TYPES` format are rows in `prepare.prepare_block`'s planes.
    Returns `[BR]` float32 for (a, slot 0..3), then (b, slot 0..3)."""
    if (FMT == Q4_K and Q4K_INT8) or (FMT == Q5_K and Q5K_INT8):
        wa = addr_a.to(tl.pointer_type(tl.int32)) + rows * (row_bytes // 4)
        wb = addr_b.to(tl.pointer_type(tl.int32)) + rows * (row_bytes // 4)
        out = _k45_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, K, BT, TWO, (BLOCKS + 7) // 8, FMT == Q5_K)
    elif FMT == Q4_K or FMT == Q5_K:
        wa = addr_a.to(tl.pointer_type(tl.int32)) + rows * (row_bytes // 4)
        wb = addr_b.to(tl.pointer_type(tl.int32)) + rows * (row_bytes // 4)
        out = _kquant_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic, K, BT, TWO, FMT == Q5_K)
    elif FMT == Q6_K:
        wa = addr_a.to(tl.pointer_type(tl.int16)) + rows * (row_bytes // 2)
        wb = addr_b.to(tl.pointer_type(tl.int16)) + rows * (row_bytes // 2)
        out = _q6k_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic, K, BT, TWO)
    elif FMT == MXFP4_PLANAR:
        ca, sa = _planar_rows(addr_a, rows, row_bytes, K)
        cb, sb = _planar_rows(addr_b, rows, row_bytes, K)
        if MXFP4_INT8:
            out = _b32_rows(ca, cb, x0, x1, x2, x3, s0, s1, s2, s3, K, BT, TWO, BLOCKS, 2, sa, sb, True)
        else:
            out = _mxfp4_rows(ca, sa, cb, sb, x0, x1, x2, x3, K, BT, TWO, BLOCKS, True)
    elif FMT == MXFP4:
        wa = addr_a.to(tl.pointer_type(tl.uint8)) + rows * row_bytes
        wb = addr_b.to(tl.pointer_type(tl.uint8)) + rows * row_bytes
        if MXFP4_INT8:
            out = _b32_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, K, BT, TWO, BLOCKS, 2, wa, wb, False)
        else:
            out = _mxfp4_rows(wa, wa, wb, wb, x0, x1, x2, x3, K, BT, TWO, BLOCKS, False)
    else:
        tl.static_assert(FMT == Q8_0 or FMT == Q4_0, "rows_dot: no kernel for this format")
        wa = addr_a.to(tl.pointer_type(tl.int16)) + rows * (row_bytes // 2)
        wb = addr_b.to(tl.pointer_type(tl.int16)) + rows * (row_bytes // 2)
        if (FMT == Q8_0 and Q80_INT8) or (FMT == Q4_0 and Q40_INT8):
            out = _b32_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, K, BT, TWO, BLOCKS, 1 if FMT == Q4_0 else 0,
                            wa, wb, False)
        elif FMT == Q8_0:
            out = _q80_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic, K, BT, TWO,
                            BLOCKS)
        else:
            out = _q40_rows(wa, wb, x0, x1, x2, x3, s0, s1, s2, s3, magic, K, BT, TWO,
                            BLOCKS)
    return out

