"""GGUF block formats as data, with torch dequantization, quantization and random blocks.

Each format is one small class registered by its ggml type: `block_size` weights are stored in
`type_size` bytes. `dequantize_blocks` maps uint8 `[n, type_size]` to float32 `[n, block_size]` and is
bit-exact against `gguf.quants.dequantize`: the same float operations in the same order (fp16 scales
widened to float32 first, products formed as the reference forms them). Everything is plain torch,
vectorised over blocks, so the same code runs on CUDA tensors. The K-quant quantizers follow llama.cpp's
reference quantizers (`quantize_row_q{4,5,6}_K_ref`); Q8_0 and Q4_0 match gguf's quantizers bit for bit.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType
_CHUNK_BLOCKS = 256  # K-quant fitting works on [blocks, candidates, weights]; small chunks stay in cache


class QuantFormat(ABC):
    qtype: ClassVar[QType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    can_quantize: ClassVar[bool]
    # (byte offset, value relative to d in random blocks) of each fp16 scale in a block
    f16_fields: ClassVar[tuple[tuple[int, float], ...]] = ()
    # expected RMS of the weights of uniformly random codes with d = 1 (and the f16_fields ratios)
    code_rms: ClassVar[float] = 1.0
    _registry: ClassVar[dict[QType, type[QuantFormat]]] = {}

    def __init_subclass__(cls, qtype: QType | None = None) -> None:
        if qtype is None:  # a family base such as _FloatFormat, not a format
            return
        cls.qtype = qtype
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        cls.can_quantize = "quantize_blocks" in cls.__dict__
        QuantFormat._registry[qtype] = cls

    @classmethod
    @abstractmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 `[n, type_size]` -> float32 `[n, block_size]`."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        """float32 `[n, block_size]` -> uint8 `[n, type_size]`."""
        names = ", ".join(t.name for t, f in QuantFormat._registry.items() if f.can_quantize)
        raise ValueError(f"{cls.qtype.name} has no quantizer (quantizable types: {names})")

    @classmethod
    def random_blocks(cls, num_blocks: int, generator: torch.Generator, scale: float) -> torch.Tensor:
        """Random codes with the fp16 scales set so that the weights' RMS is about `scale`."""
        blocks = _random_bytes(num_blocks * cls.type_size, generator).view(num_blocks, cls.type_size)
        if not cls.f16_fields:
            return blocks
        # NOTE: fp16 fields sit at even offsets of even-sized blocks, so int16 views reach them
        fields, first = blocks.view(torch.int16), cls.f16_fields[0][0] // 2
        u = fields[:, first : first + 1].float() / 65536  # the first field's random bits: [n, 1] in [-0.5, 0.5)
        d = (scale / cls.code_rms) * torch.exp2(u)
        for offset, ratio in cls.f16_fields:
            fields[:, offset // 2 : offset // 2 + 1] = (d * ratio).half().view(torch.int16)
        return blocks


# --- shared pieces -----------------------------------------------------------------------------------


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 stored in uint8 `[n, 2*k]` -> float32 `[n, k]`."""
    return raw.contiguous().view(torch.float16).float()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 `[n, k]` -> its fp16 bytes, uint8 `[n, 2*k]` (round to nearest even, as ggml)."""
    out = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=torch.uint8, device=x.device)
    out.view(torch.float16).copy_(x)  # a fresh tensor: the dtype view works for empty ones too
    return out


def _unpack(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 `[..., k]` -> the `8 // bits` fields of each byte, lowest first: uint8 `[..., 8 // bits, k]`."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=raw.device).view(-1, 1)
    return (raw.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _pack(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_unpack`: uint8 `[..., 8 // bits, k]` (each < 2**bits) -> uint8 `[..., k]`."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=fields.device).view(-1, 1)
    return (fields << shifts).sum(-2).to(torch.uint8)  # fields do not overlap, so the sum is an OR


def _bits_le(raw: torch.Tensor) -> torch.Tensor:
    """uint8 `[n, k]` -> bit i of the little-endian integer, uint8 `[n, 8*k]`."""
    return _unpack(raw, 1).transpose(-1, -2).flatten(-2)


_TABLES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _lookup(values: tuple[int, ...], codes: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) -> float32 table entries. The table is made once per device: a captured CUDA graph
    (whose warm-up made it) copies nothing from the host."""
    key = (values, codes.device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=codes.device)
    return _TABLES[key][codes.long()]


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # C roundf, written as gguf's np_roundf so the result matches it exactly
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _chunked(quantize_chunk: Callable[[torch.Tensor], torch.Tensor]) -> classmethod:
    """A `quantize_blocks` that runs `quantize_chunk` on float32 chunks of `_CHUNK_BLOCKS` blocks."""

    def quantize_blocks(cls: type[QuantFormat], blocks: torch.Tensor) -> torch.Tensor:
        return torch.cat([quantize_chunk(x) for x in blocks.float().contiguous().split(_CHUNK_BLOCKS)])

    return classmethod(quantize_blocks)


def _random_bytes(num_bytes: int, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random uint8 `[num_bytes]` on the generator's device, decided by `generator`."""
    if generator.device.type == "cpu":
        # numpy's SFC64 seeded from `generator` makes bytes ~7x faster than torch's CPU generator
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        words = np.random.SFC64(seed).random_raw((num_bytes + 7) // 8)
        return torch.from_numpy(words.view(np.uint8)[:num_bytes])
    ints = torch.empty((num_bytes + 3) // 4, dtype=torch.int32, device=generator.device)
    return ints.random_(-(2**31), 2**31, generator=generator).view(torch.uint8)[:num_bytes]


# --- float formats -----------------------------------------------------------------------------------


class _FloatFormat(QuantFormat):
    # random blocks of float formats are Gaussian weights (random bytes would hold NaNs)
    @classmethod
    def random_blocks(cls, num_blocks: int, generator: torch.Generator, scale: float) -> torch.Tensor:
        x = torch.randn(num_blocks, cls.block_size, generator=generator, device=generator.device)
        return cls.quantize_blocks(x * scale)


class F32(_FloatFormat, qtype=QType.F32):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float32).clone()

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.float().contiguous().view(torch.uint8)


class F16(_FloatFormat, qtype=QType.F16):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return _f16(blocks)

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return _f16_bytes(blocks)


class BF16(_FloatFormat, qtype=QType.BF16):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.bfloat16).float()

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.bfloat16().contiguous().view(torch.uint8)


# --- 32-weight formats -------------------------------------------------------------------------------


class Q4_0(QuantFormat, qtype=QType.Q4_0):
    # fp16 d, 16 bytes of 4-bit q (low nibbles are weights 0..15); w = d * (q - 8)
    f16_fields = ((0, 1.0),)
    code_rms = 4.637

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q = _unpack(blocks[:, 2:], 4).flatten(1).float() - 8  # [n, 32]
        return _f16(blocks[:, :2]) * q

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        # d from the signed value of largest magnitude (the first of ties), which maps to code 0
        peak = blocks.gather(1, blocks.abs().argmax(1, keepdim=True))
        d = peak / -8
        q = torch.trunc(blocks * torch.where(d == 0, 0.0, 1 / d) + 8.5).clamp(0, 15).to(torch.uint8)
        return torch.cat([_f16_bytes(d), _pack(q.view(-1, 2, 16), 4)], dim=1)


class Q4_1(QuantFormat, qtype=QType.Q4_1):
    # fp16 d, fp16 m, 16 bytes of 4-bit q; w = d * q + m
    f16_fields = ((0, 1.0), (2, -7.5))
    code_rms = 4.610

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q = _unpack(blocks[:, 4:], 4).flatten(1).float()
        return _f16(blocks[:, :2]) * q + _f16(blocks[:, 2:4])


class Q5_0(QuantFormat, qtype=QType.Q5_0):
    # fp16 d, 32 high bits (uint32), 16 bytes of low nibbles; w = d * (q - 16)
    f16_fields = ((0, 1.0),)
    code_rms = 9.247

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q = _unpack(blocks[:, 6:], 4).flatten(1) | (_bits_le(blocks[:, 2:6]) << 4)
        return _f16(blocks[:, :2]) * (q.float() - 16)


class Q5_1(QuantFormat, qtype=QType.Q5_1):
    # fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles; w = d * q + m
    f16_fields = ((0, 1.0), (2, -15.5))
    code_rms = 9.233

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q = _unpack(blocks[:, 8:], 4).flatten(1) | (_bits_le(blocks[:, 4:8]) << 4)
        return _f16(blocks[:, :2]) * q.float() + _f16(blocks[:, 2:4])


class Q8_0(QuantFormat, qtype=QType.Q8_0):
    # fp16 d, int8 qs[32]; w = d * q
    f16_fields = ((0, 1.0),)
    code_rms = 73.90

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return _f16(blocks[:, :2]) * q

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = _round_half_away(blocks * torch.where(d == 0, 0.0, 1 / d))
        return torch.cat([_f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


class IQ4_NL(QuantFormat, qtype=QType.IQ4_NL):
    # fp16 d, 16 bytes of 4-bit indices into a non-linear table; w = d * table[q]
    f16_fields = ((0, 1.0),)
    code_rms = 67.44

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        values = _lookup(IQ4_NL_VALUES, _unpack(blocks[:, 2:], 4).flatten(1))
        return _f16(blocks[:, :2]) * values


class MXFP4(QuantFormat, qtype=QType.MXFP4):
    # e8m0 exponent e, 16 bytes of 4-bit e2m1 codes; w = 2**(e - 128) * doubled_e2m1[q]
    code_rms = 5.852

    @staticmethod
    def half_scale(e: torch.Tensor) -> torch.Tensor:
        """e8m0 byte -> float32 2**(e - 128), subnormal below e = 2 (ggml_e8m0_to_fp32_half)."""
        e = e.int()
        bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        return bits.view(torch.float32)

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        values = _lookup(MXFP4_VALUES, _unpack(blocks[:, 1:], 4).flatten(1))
        return cls.half_scale(blocks[:, :1]) * values

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        # gguf's reference: e = floor(log2(max |w|)) - 2 + 127, each weight the nearest code (the first on ties)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0).to(torch.uint8)  # [n, 1]
        table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
        codes = (cls.half_scale(e)[:, :, None] * table - blocks[:, :, None]).abs().argmin(dim=-1)  # [n, 32]
        return torch.cat([e, _pack(codes.to(torch.uint8).view(-1, 2, cls.block_size // 2), 4)], dim=1)

    @classmethod
    def random_blocks(cls, num_blocks: int, generator: torch.Generator, scale: float) -> torch.Tensor:
        blocks = _random_bytes(num_blocks * cls.type_size, generator).view(num_blocks, cls.type_size)
        # e = 128 + log2(scale / code_rms), rounded up or down at random so that blocks vary
        exponent = 128 + math.log2(scale / cls.code_rms)
        u = torch.rand(num_blocks, generator=generator, device=generator.device)
        blocks[:, 0] = (exponent + u).floor().clamp(2, 254).to(torch.uint8)
        return blocks


# --- K-quants: super-blocks of 256 weights -----------------------------------------------------------


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes of 6-bit (scale, min) pairs, uint8 `[n, 12]` -> scales `[n, 8]`, mins `[n, 8]`."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return scales, mins


def _pack_scale_min_k4(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Inverse of `_scale_min_k4`: uint8 `[n, 8]` twice (values < 64) -> uint8 `[n, 12]`."""
    s_lo, s_hi, m_lo, m_hi = scales[:, :4], scales[:, 4:], mins[:, :4], mins[:, 4:]
    low = torch.cat([s_lo | ((s_hi >> 4) << 6), m_lo | ((m_hi >> 4) << 6)], dim=1)
    return torch.cat([low, (s_hi & 15) | ((m_hi & 15) << 4)], dim=1)


def _affine_k(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K blocks and their float codes `[n, 8, 32]` -> weights `[n, 256]`."""
    n = blocks.shape[0]
    sc, m = _scale_min_k4(blocks[:, 4:16])
    dl = (_f16(blocks[:, 0:2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(blocks[:, 2:4]) * m.float()).view(n, 8, 1)
    return (dl * q - dm).view(n, 256)


def _level_sums(levels: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Candidate levels `[m, c, k]`, weights and values `[m, k]` -> sums over k of w*L, w*x*L, w*L^2,
    each `[m, c]` (as batched matmuls: several times faster than elementwise products and sums)."""
    s = torch.bmm(levels, torch.stack([w, w * x], dim=-1))
    s_l2 = torch.bmm(levels.square(), w.unsqueeze(-1))
    return s[..., 0], s[..., 1], s_l2[..., 0]


def _fit_affine(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants on sub-blocks `x [m, k]`: x ~ scale * L - min with L in [0, nmax],
    the best weighted least-squares fit over a sweep of inverse scales. Returns scale `[m]`, min `[m]`."""
    w = x.square().mean(-1, keepdim=True).sqrt() + x.abs()  # llama.cpp's weights favour large |x|
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    span = x.amax(-1, keepdim=True) - lo
    sweep = torch.arange(-1, nstep + 1, device=x.device) * 0.1 + (rmin + nmax)
    sweep[0] = nmax  # candidate 0 is the plain min/max fit
    unit = (x - lo) / torch.where(span > 0, span, 1)  # [m, k] in [0, 1]
    levels = (unit.unsqueeze(1) * sweep.view(1, -1, 1)).round_().clamp_(max=nmax)  # [m, c, k]
    s_l, s_xl, s_l2 = _level_sums(levels, w, x)
    wx = w * x
    s_w, s_x, s_x2 = w.sum(-1, keepdim=True), wx.sum(-1, keepdim=True), (wx * x).sum(-1, keepdim=True)
    det = s_w * s_l2 - s_l * s_l
    scale = (s_w * s_xl - s_x * s_l) / det
    offset = (s_l2 * s_x - s_l * s_xl) / det
    is_clamped = offset > 0  # the fitted min must not be positive
    scale = torch.where(is_clamped, s_xl / s_l2, scale)
    offset = torch.where(is_clamped, 0.0, offset)
    scale[:, 0], offset[:, 0] = span[:, 0] / nmax, lo[:, 0]
    # weighted squared error sum(w * (scale * L + offset - x)^2), expanded into the sums
    err = scale * (scale * s_l2 + 2 * offset * s_l - 2 * s_xl) + offset * (offset * s_w - 2 * s_x) + s_x2
    is_valid = det > 0
    is_valid[:, 0] = True
    best = torch.where(is_valid, err, math.inf).argmin(-1, keepdim=True)
    return scale.gather(1, best).squeeze(1), -offset.gather(1, best).squeeze(1)


def _quantize_affine_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """llama.cpp's quantize_row_q{4,5}_K_ref on super-blocks `x [n, 256]` -> fp16 d and dmin as bytes
    `[n, 4]`, packed scales `[n, 12]`, levels `[n, 8, 32]`."""
    n = x.shape[0]
    sub = x.view(n, 8, 32)
    scales, mins = (t.view(n, 8) for t in _fit_affine(sub.reshape(-1, 32), nmax, rmin, nstep))
    max_scale, max_min = scales.amax(1, keepdim=True), mins.amax(1, keepdim=True)
    sc = torch.round(scales * torch.where(max_scale > 0, 63 / max_scale, 0)).clamp(0, 63).to(torch.uint8)
    mn = torch.round(mins * torch.where(max_min > 0, 63 / max_min, 0)).clamp(0, 63).to(torch.uint8)
    d_bytes, dmin_bytes = _f16_bytes(max_scale / 63), _f16_bytes(max_min / 63)
    # requantize against the scales as they will be decoded
    dl = (_f16(d_bytes) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(dmin_bytes) * mn.float()).unsqueeze(-1)
    levels = torch.round((sub + dm) / torch.where(dl > 0, dl, 1)).clamp(0, nmax)
    levels = torch.where(dl > 0, levels, 0).to(torch.uint8)
    return torch.cat([d_bytes, dmin_bytes], dim=1), _pack_scale_min_k4(sc, mn), levels


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    head, packed, levels = _quantize_affine_k(x, nmax=15, rmin=-1.0, nstep=20)
    qs = _pack(levels.view(-1, 4, 2, 32), 4).flatten(1)
    return torch.cat([head, packed, qs], dim=1)


def _quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    head, packed, levels = _quantize_affine_k(x, nmax=31, rmin=-0.5, nstep=15)
    qs = _pack((levels & 15).view(-1, 4, 2, 32), 4).flatten(1)
    return torch.cat([head, packed, _pack(levels >> 4, 1), qs], dim=1)


def _fit_symmetric(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """llama.cpp's make_qx_quants (rmse_type 1) on sub-blocks `x [m, k]`: x ~ scale * L with L in
    [-nmax, nmax - 1], the best x^2-weighted fit over a sweep of inverse scales. Returns scale `[m]`."""
    peak = x.gather(1, x.abs().argmax(1, keepdim=True))  # signed value of largest magnitude, [m, 1]
    is_zero = peak.abs() < 1e-15
    steps = torch.tensor([0, *range(-9, 0), *range(1, 10)], dtype=torch.float32, device=x.device)
    unit = x / torch.where(is_zero, 1, peak)  # [m, k] in [-1, 1]
    levels = (unit.unsqueeze(1) * -(nmax + 0.1 * steps).view(1, -1, 1)).round_()  # [m, c, k]
    _, s_xl, s_l2 = _level_sums(levels.clamp_(-nmax, nmax - 1), x.square(), x)
    has_levels = s_l2 > 0
    scale = torch.where(has_levels, s_xl / torch.where(has_levels, s_l2, 1), 0)
    best = (scale * s_xl).argmax(-1, keepdim=True)  # s_xl^2 / s_l2: the error reduction of the fit
    return torch.where(is_zero, 0, scale.gather(1, best)).squeeze(1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q6_K_ref on super-blocks `x [n, 256]`."""
    n = x.shape[0]
    sub = x.view(n, 16, 16)
    scales = _fit_symmetric(sub.reshape(-1, 16), nmax=32).view(n, 16)
    max_scale = scales.gather(1, scales.abs().argmax(1, keepdim=True))  # [n, 1]
    is_zero = max_scale.abs() < 1e-15
    inv = torch.where(is_zero, 0, -128 / torch.where(is_zero, 1, max_scale))
    sc = torch.round(inv * scales).clamp(-128, 127)
    d_bytes = _f16_bytes(torch.where(is_zero, 0, 1 / torch.where(is_zero, 1, inv)))
    dl = (_f16(d_bytes) * sc).unsqueeze(-1)  # [n, 16, 1], as decoded
    levels = torch.round(sub / torch.where(dl != 0, dl, 1)).clamp(-32, 31)
    levels = (torch.where(dl != 0, levels, 0) + 32).to(torch.uint8).view(n, 2, 128)
    ql = _pack((levels & 15).view(n, 2, 2, 64), 4).flatten(1)
    qh = _pack((levels >> 4).view(n, 2, 4, 32), 2).flatten(1)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d_bytes], dim=1)


class Q2_K(QuantFormat, qtype=QType.Q2_K):
    # scales[16] (low nibble scale, high nibble min), 64 bytes of 2-bit q, fp16 d, fp16 dmin;
    # w = d * sc * q - dmin * m per 16 weights
    f16_fields = ((80, 1.0), (82, 1.5))
    code_rms = 13.87

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n, packed = blocks.shape[0], blocks[:, :16]
        dl = (_f16(blocks[:, 80:82]) * (packed & 15).float()).view(n, 16, 1)
        ml = (_f16(blocks[:, 82:84]) * (packed >> 4).float()).view(n, 16, 1)
        q = _unpack(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
        return (dl * q - ml).view(n, 256)


class Q3_K(QuantFormat, qtype=QType.Q3_K):
    # hmask[32], 64 bytes of low 2 bits, 12 bytes of 6-bit scales, fp16 d;
    # w = d * (sc - 32) * (q - 4 * (1 - hbit)) per 16 weights
    f16_fields = ((108, 1.0),)
    code_rms = 43.34

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n, packed = blocks.shape[0], blocks[:, 96:108]
        low = _unpack(packed[:, :8].reshape(n, 1, 8), 4).reshape(n, 16)
        high = _unpack(packed[:, 8:].reshape(n, 1, 4), 2).reshape(n, 16)
        sc = ((low | (high << 4)).to(torch.int8) - 32).float()
        dl = (_f16(blocks[:, 108:110]) * sc).view(n, 16, 1)
        ql = _unpack(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16).to(torch.int8)
        hbit = _unpack(blocks[:, :32].reshape(n, 1, 32), 1).reshape(n, 16, 16).to(torch.int8)
        return (dl * (ql - ((hbit ^ 1) << 2)).float()).view(n, 256)


class Q4_K(QuantFormat, qtype=QType.Q4_K):
    # fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min), 128 bytes of 4-bit q;
    # w = d * sc * q - dmin * m per 32 weights
    f16_fields = ((0, 1.0), (2, 7.5))
    code_rms = 258.3

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        q = _unpack(blocks[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32)
        return _affine_k(blocks, q.float())

    quantize_blocks = _chunked(_quantize_q4_k)


class Q5_K(QuantFormat, qtype=QType.Q5_K):
    # as Q4_K, then 32 bytes of high bits (bit j of byte i is weight 32 * j + i), 128 bytes of nibbles
    f16_fields = ((0, 1.0), (2, 15.5))
    code_rms = 526.9

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        low = _unpack(blocks[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
        high = _unpack(blocks[:, 16:48], 1)  # [n, 8, 32]
        return _affine_k(blocks, (low | (high << 4)).float())

    quantize_blocks = _chunked(_quantize_q5_k)


class Q6_K(QuantFormat, qtype=QType.Q6_K):
    # 128 bytes of low nibbles, 64 bytes of high 2 bits, int8 scales[16], fp16 d;
    # w = d * sc * (q - 32) per 16 weights
    f16_fields = ((208, 1.0),)
    code_rms = 1365.7

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
        dl = (_f16(blocks[:, 208:210]) * sc).view(n, 16, 1)
        low = _unpack(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
        high = _unpack(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
        return (dl * q).view(n, 256)

    quantize_blocks = _chunked(_quantize_q6_k)


class IQ4_XS(QuantFormat, qtype=QType.IQ4_XS):
    # fp16 d, uint16 high scale bits, 4 bytes of low scale nibbles, 128 bytes of 4-bit table indices;
    # w = d * (sc - 32) * table[q] per 32 weights
    f16_fields = ((0, 1.0),)
    code_rms = 1246.3

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        low = _unpack(blocks[:, 4:8].reshape(n, 4, 1), 4).reshape(n, 8)
        high = _unpack(blocks[:, 2:4].reshape(n, 2, 1), 2).reshape(n, 8)
        sc = ((low | (high << 4)).to(torch.int8) - 32).float()
        dl = (_f16(blocks[:, :2]) * sc).view(n, 8, 1)
        codes = _unpack(blocks[:, 8:].reshape(n, 8, 16), 4).reshape(n, 8, 32)
        return (dl * _lookup(IQ4_NL_VALUES, codes)).view(n, 256)


# --- public API --------------------------------------------------------------------------------------


def format_of(qtype: QType | int) -> type[QuantFormat]:
    """The format class of a ggml type; ValueError naming the type if it is not supported."""
    try:
        return QuantFormat._registry[QType(qtype)]
    except ValueError:
        raise ValueError(f"unknown tensor type {qtype!r}") from None
    except KeyError:
        supported = ", ".join(t.name for t in supported_types())
        raise ValueError(f"unsupported tensor type {QType(qtype).name} (supported: {supported})") from None


def supported_types() -> list[QType]:
    return list(QuantFormat._registry)


def row_bytes(qtype: QType | int, num_cols: int) -> int:
    """Bytes of one row of `num_cols` weights."""
    fmt = format_of(qtype)
    if num_cols % fmt.block_size:
        raise ValueError(f"{fmt.qtype.name}: row of {num_cols} is not a multiple of {fmt.block_size}")
    return num_cols // fmt.block_size * fmt.type_size


def as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A uint8 torch view of raw tensor bytes (no copy for numpy memmaps)."""
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    return raw if raw.dtype == torch.uint8 else raw.contiguous().view(torch.uint8)


def dequantize(raw: torch.Tensor | np.ndarray, qtype: QType | int, num_cols: int) -> torch.Tensor:
    """Raw bytes `[..., row_bytes]` -> float32 `[..., num_cols]`, on the device of `raw`."""
    fmt = format_of(qtype)
    data = as_bytes(raw)
    expected = row_bytes(qtype, num_cols)
    if data.dim() == 0 or data.shape[-1] != expected:
        raise ValueError(f"{fmt.qtype.name}: rows of {num_cols} take {expected} bytes, got shape {tuple(data.shape)}")
    out = fmt.dequantize_blocks(data.reshape(-1, fmt.type_size))
    return out.reshape(*data.shape[:-1], num_cols)


def quantize(x: torch.Tensor, qtype: QType | int) -> torch.Tensor:
    """float32 `[..., n]` -> raw bytes `[..., row_bytes]`."""
    fmt = format_of(qtype)
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension")
    lead, n = x.shape[:-1], x.shape[-1]
    num_bytes = row_bytes(qtype, n)
    out = fmt.quantize_blocks(x.float().reshape(-1, fmt.block_size))
    return out.reshape(*lead, num_bytes)


def random_blocks(qtype: QType | int, num_blocks: int, generator: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """Valid random blocks, uint8 `[num_blocks, type_size]` on the generator's device, whose weights are
    finite with RMS about `scale` (within a factor of about 1.5 on average over many blocks)."""
    if num_blocks < 0 or not scale > 0:
        raise ValueError(f"need num_blocks >= 0 and scale > 0, got {num_blocks} and {scale}")
    return format_of(qtype).random_blocks(num_blocks, generator, scale)
