"""Multi-head latent attention's projections around the attention of a decode step (DeepSeek-V2/V3), each one launch
where the composed torch ops take nine and three (`ops.fused.mla_qk`, `ops.fused.mla_out`: their dispatchers and
torch references).

`mla_qk`: program (token, head, block of latent rows) computes those rows of the head's nope query times the key
decompression k_b (absorbed: the head then attends to the latent directly); the first block's program also rotates
the head's rope part and scales it, and head 0's first program RMS-norms the token's latent, rotates the shared key
and stores both into the latent cache. `mla_out`: program (token, head, block of value rows) decompresses the head's
latent output with v_b into the output projection's input row. Both compute in float32 and round once to the input
dtype, where the torch references round after each op. No host sync and grids from shapes only: a captured step
holds them.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.fused import RopeStyle
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_vector

QK_ROWS = 64  # latent rows a program of mla_qk computes (a tile of QK_ROWS x nope)
OUT_ROWS = 16  # value rows a program of mla_out computes (a tile of OUT_ROWS x rank)
MAX_DIM = 1024  # a program holds a whole nope part, latent row or rope part


@triton.jit
def _rotate(src, positions_at, inv_freq, half, gain, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """The rotated pairs (first, second) of `2 * half` values at src, float32 times gain, and their offsets."""
    i = tl.arange(0, BLOCK)
    in_half = i < half
    if NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    a = tl.load(src + first, mask=in_half, other=0.0).to(tl.float32)
    b = tl.load(src + second, mask=in_half, other=0.0).to(tl.float32)
    angle = positions_at.to(tl.float32) * tl.load(inv_freq + i, mask=in_half, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    return (a * cos - b * sin) * gain, (b * cos + a * sin) * gain, first, second, in_half


@triton.jit
def _mla_qk_kernel(q, q_token_stride, q_head_stride, kv, kv_token_stride, k_b, kv_norm, positions, inv_freq, out,
                   cache, slot_ids, cache_slot_stride, cache_pos_stride, heads, nope, rank, half, eps, gain,
                   NEOX: tl.constexpr, NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
                   ROWS: tl.constexpr):
    token, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    width = rank + 2 * half  # out's and the cache's rows
    src = q + token.to(tl.int64) * q_token_stride + head.to(tl.int64) * q_head_stride
    dst = out + (token.to(tl.int64) * heads + head) * width
    d = tl.arange(0, NOPE)
    q_nope = tl.load(src + d, mask=d < nope, other=0.0).to(tl.float32)
    r = block * ROWS + tl.arange(0, ROWS)
    tile = tl.load(k_b + head.to(tl.int64) * rank * nope + r[:, None] * nope + d[None, :],
                   mask=(r[:, None] < rank) & (d[None, :] < nope), other=0.0).to(tl.float32)
    tl.store(dst + r, tl.sum(tile * q_nope[None, :], axis=1).to(out.dtype.element_ty), mask=r < rank)
    position = tl.load(positions + token)
    if block == 0:
        a, b, first, second, in_half = _rotate(src + nope, position, inv_freq, half, gain, NEOX, HALF)
        tl.store(dst + rank + first, a.to(out.dtype.element_ty), mask=in_half)
        tl.store(dst + rank + second, b.to(out.dtype.element_ty), mask=in_half)
        if head == 0:  # the token's cache entry: the normed latent, the rotated shared key
            row = cache + tl.load(slot_ids + token).to(tl.int64) * cache_slot_stride + \
                position.to(tl.int64) * cache_pos_stride
            latent_src = kv + token.to(tl.int64) * kv_token_stride
            c = tl.arange(0, RANK)
            latent = tl.load(latent_src + c, mask=c < rank, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.sum(latent * latent, axis=0) / rank + eps)
            weight = tl.load(kv_norm + c, mask=c < rank, other=0.0).to(tl.float32)
            tl.store(row + c, (latent * scale * weight).to(cache.dtype.element_ty), mask=c < rank)
            ka, kb, first, second, in_half = _rotate(latent_src + rank, position, inv_freq, half, 1.0, NEOX, HALF)
            tl.store(row + rank + first, ka.to(cache.dtype.element_ty), mask=in_half)
            tl.store(row + rank + second, kb.to(cache.dtype.element_ty), mask=in_half)


def mla_qk(q: torch.Tensor, kv: torch.Tensor, k_b: torch.Tensor, kv_norm: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor, style: RopeStyle, eps: float, rope_gain: float, cache: torch.Tensor,
           slot_ids: torch.Tensor) -> torch.Tensor:
    """See `ops.fused.mla_qk`. q `[tokens, heads, nope + rope]` and kv `[tokens, rank + rope]` with contiguous rows
    (any token and head strides); k_b `[heads, rank, nope]` contiguous, of q's dtype; cache `[slots, 1, max_len, rank
    + rope]` of q's dtype with contiguous rows."""
    device = q.device
    for name, t in (("q", q), ("kv", kv), ("k_b", k_b), ("cache", cache)):
        check_device(name, t, device)
        if t.dtype != q.dtype or t.dtype not in FLOAT_DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {q.dtype} (a float type) with contiguous rows, got {t.dtype} "
                             f"strides {t.stride()}")
    if q.dim() != 3 or k_b.dim() != 3 or k_b.shape[0] != q.shape[1] or not k_b.is_contiguous():
        raise ValueError(f"q [tokens, heads, nope + rope] and k_b [heads, rank, nope] (contiguous): got "
                         f"{tuple(q.shape)} and {tuple(k_b.shape)}")
    tokens, heads, _ = q.shape
    rank, nope = k_b.shape[1], k_b.shape[2]
    rope = q.shape[2] - nope
    if rope <= 0 or rope % 2 or kv.shape != (tokens, rank + rope) or max(nope, rank, rope) > MAX_DIM:
        raise ValueError(f"kv: expected [{tokens}, {rank} + an even rope part of q's {q.shape[2]} - {nope}] "
                         f"(each part at most {MAX_DIM}), got {tuple(kv.shape)}")
    if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != rank + rope:
        raise ValueError(f"cache: expected [slots, 1, max_len, {rank + rope}], got {tuple(cache.shape)}")
    if style not in ("neox", "normal"):
        raise ValueError(f"style: expected 'neox' or 'normal', got {style!r}")
    check_vector("kv_norm", kv_norm, rank, (q.dtype,), device)
    check_vector("positions", positions, tokens, INDEX_DTYPES, device)
    check_vector("slot_ids", slot_ids, tokens, INDEX_DTYPES, device)
    check_vector("inv_freq", inv_freq, rope // 2, (torch.float32,), device)
    out = torch.empty((tokens, heads, rank + rope), dtype=q.dtype, device=device)
    if tokens and heads:
        _mla_qk_kernel[(tokens, heads, triton.cdiv(rank, QK_ROWS))](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), k_b, kv_norm, positions, inv_freq, out, cache, slot_ids,
            cache.stride(0), cache.stride(2), heads, nope, rank, rope // 2, float(eps), float(rope_gain),
            NEOX=style == "neox", NOPE=triton.next_power_of_2(nope), RANK=triton.next_power_of_2(rank),
            HALF=triton.next_power_of_2(rope // 2), ROWS=QK_ROWS, num_warps=4)
    return out


@triton.jit
def _mla_out_kernel(x, x_token_stride, x_head_stride, v_b, out, heads, rank, v_dim, RANK: tl.constexpr,
                    ROWS: tl.constexpr):
    token, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = tl.arange(0, RANK)
    latent = tl.load(x + token.to(tl.int64) * x_token_stride + head.to(tl.int64) * x_head_stride + c,
                     mask=c < rank, other=0.0).to(tl.float32)
    v = block * ROWS + tl.arange(0, ROWS)
    tile = tl.load(v_b + head.to(tl.int64) * v_dim * rank + v[:, None] * rank + c[None, :],
                   mask=(v[:, None] < v_dim) & (c[None, :] < rank), other=0.0).to(tl.float32)
    dst = out + (token.to(tl.int64) * heads + head) * v_dim
    tl.store(dst + v, tl.sum(tile * latent[None, :], axis=1).to(out.dtype.element_ty), mask=v < v_dim)


def mla_out(x: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """See `ops.fused.mla_out`. x `[tokens, heads, rank]` with contiguous rows; v_b `[heads, v_dim, rank]`
    contiguous, of x's dtype."""
    check_device("v_b", v_b, x.device)
    if (x.dim() != 3 or v_b.dim() != 3 or x.dtype not in FLOAT_DTYPES or v_b.dtype != x.dtype or x.stride(2) != 1
            or not v_b.is_contiguous() or v_b.shape[0] != x.shape[1] or v_b.shape[2] != x.shape[2]
            or x.shape[2] > MAX_DIM):
        raise ValueError(f"x [tokens, heads, rank <= {MAX_DIM}] (contiguous rows) and v_b [heads, v_dim, rank] "
                         f"(contiguous) of one float type: got {x.dtype} {tuple(x.shape)} and {v_b.dtype} "
                         f"{tuple(v_b.shape)}")
    tokens, heads, rank = x.shape
    v_dim = v_b.shape[1]
    out = torch.empty((tokens, heads * v_dim), dtype=x.dtype, device=x.device)
    if tokens and heads:
        _mla_out_kernel[(tokens, heads, triton.cdiv(v_dim, OUT_ROWS))](
            x, x.stride(0), x.stride(1), v_b, out, heads, rank, v_dim, RANK=triton.next_power_of_2(rank),
            ROWS=OUT_ROWS, num_warps=4)
    return out
