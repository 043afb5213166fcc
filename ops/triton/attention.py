"""Decode attention straight from the KV cache: split-K ("flash-decoding") in two launches.

Each decode token attends to positions 0..positions[i] of its slot in the contiguous cache
`[num_slots, kv_heads, max_len, head_dim]`. The first kernel runs one program per (token, kv head,
split of the positions): it reads its chunk of K/V once for all the q heads of the kv-head group
(GQA) and keeps an online softmax in float32. The second combines the splits of each (token, head)
by their log-sum-exp. Splits past a token's position do no work; loop bounds come from the loaded
positions and the grid from the shapes only, so a step can be captured in a CUDA graph. This
replaces a gather (a full copy of K/V), a mask and SDPA.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_vector, interpreting

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # (token, kv head, split) programs: ~2 per SM of a 132-SM H100/H200 (untuned)
_MIN_SPLIT_LEN = 256  # shorter splits add partials to combine for little K/V each; 256 keeps the smallest
# KV bucket of a captured decode step at one split, without the combine launch (H200: docs/benchmarks.md)


@triton.jit
def _last_position(positions, token, max_len):
    # NOTE: positions in [0, max_len) is the caller's invariant (checking needs a host sync); the
    # clamp only keeps a bad one inside the slot
    return tl.minimum(tl.maximum(tl.load(positions + token).to(tl.int64), 0), max_len - 1)


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr):
    # WIDEN under the interpreter only: its tl.dot multiplies bf16 as their uint16 bits (Triton 3.9).
    # bf16 -> float32 is exact and the GPU accumulates in float32, so the numbers stay the same.
    if WIDEN:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # ieee: no tf32 for float32 inputs; ignored for 16-bit


@triton.jit
def _split_kernel(q, q_s0, q_s1, k, v, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, slot_ids, positions, max_len,
                  split_len, o, lse, qk_scale, GROUP: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr,
                  D: tl.constexpr, WIDEN: tl.constexpr):
    # program (token, kv head, split); rows of the tile are the group's q heads (padded to BG >= 16
    # for tl.dot), so K/V is read once per group. Scores are in the log2 domain (exp2 is cheaper).
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads, num_splits = tl.num_programs(1) * GROUP, tl.num_programs(2)
    slot = tl.load(slot_ids + token).to(tl.int64)
    last = _last_position(positions, token, max_len)
    start = split.to(tl.int64) * split_len
    end = tl.minimum(start + split_len, last + 1)
    rows, cols = tl.arange(0, BG), tl.arange(0, D)
    heads = kv_head * GROUP + rows
    q_ptrs = q + token.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + cols[None, :]
    q_tile = tl.load(q_ptrs, mask=rows[:, None] < GROUP, other=0.0)
    k_base = k + slot * k_s0 + kv_head * k_s1
    v_base = v + slot * v_s0 + kv_head * v_s1
    m = tl.full([BG], float("-inf"), tl.float32)
    l_sum = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, D], tl.float32)
    for n0 in range(start, end, BN):
        offs = n0 + tl.arange(0, BN)
        valid = offs < end
        kt = tl.load(k_base + offs[None, :] * k_s2 + cols[:, None], mask=valid[None, :], other=0.0)  # [D, BN]
        s = _dot(q_tile, kt, WIDEN) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds a valid position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + offs[:, None] * v_s2 + cols[None, :], mask=valid[:, None], other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, WIDEN)
        m = m_new
    # o and lse are [tokens, heads, splits(, D)]; with one split o is the output itself
    has_work = start < end
    l_sum = tl.where(has_work, l_sum, 1.0)  # an empty split's rows are not stored
    out_rows = (token * num_heads + heads).to(tl.int64) * num_splits + split
    is_row = rows < tl.where(has_work, GROUP, 0)  # not `& has_work`: the interpreter mis-broadcasts that
    tl.store(o + out_rows[:, None] * D + cols[None, :], acc / l_sum[:, None], mask=is_row[:, None])
    tl.store(lse + out_rows, m + tl.log2(l_sum), mask=is_row)


@triton.jit
def _combine_kernel(o, lse, positions, max_len, split_len, num_splits, out, D: tl.constexpr):
    # program (token, head): only the splits that hold work are read (the others were not written)
    token, head = tl.program_id(0), tl.program_id(1)
    last = _last_position(positions, token, max_len)
    used = tl.minimum(last // split_len + 1, num_splits)
    row = (token * tl.num_programs(1) + head).to(tl.int64)
    cols = tl.arange(0, D)
    m = tl.load(lse + row * num_splits)  # split 0 always holds work
    weight = 0.0
    acc = tl.zeros([D], tl.float32)
    for split in range(0, used):
        lse_s = tl.load(lse + row * num_splits + split)
        m_new = tl.maximum(m, lse_s)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse_s - m_new)
        acc = acc * alpha + w * tl.load(o + (row * num_splits + split) * D + cols)
        weight = weight * alpha + w
        m = m_new
    tl.store(out + row * D + cols, acc / weight)


def default_num_splits(num_tokens: int, kv_heads: int, max_len: int) -> int:
    """Splits of the positions: enough programs to fill the GPU, none shorter than _MIN_SPLIT_LEN."""
    wanted = triton.cdiv(_TARGET_PROGRAMS, max(1, num_tokens * kv_heads))
    return max(1, min(wanted, triton.cdiv(max_len, _MIN_SPLIT_LEN)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     positions: torch.Tensor, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q `[n, num_heads, head_dim]`; k_cache, v_cache `[num_slots, kv_heads, max_len, head_dim]` (any
    strides but the last: a view of the first `length` positions splits by `length`); slot_ids,
    positions int32/int64 `[n]` -> `[n, num_heads, head_dim]` in q's dtype. Token i attends to
    positions 0..positions[i] of slot slot_ids[i]; head h reads kv head h // (num_heads // kv_heads).
    num_splits: chunks of the positions (None: `default_num_splits`, from the shapes only).
    NOTE: slot_ids in [0, num_slots) and positions in [0, max_len) are not checked (no host sync)."""
    n, num_heads, head_dim = _check(q, k_cache, v_cache, slot_ids, positions)
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    # K and V tiles of at most 16 KiB each: no register spills on sm_90 at 8 warps (checked in ptxas)
    block_n = max(16, min(64, 8192 // head_dim // (q.element_size() // 2)))
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: expected at least 1, got {num_splits}")
    wanted = num_splits or default_num_splits(n, kv_heads, max_len)
    split_len = triton.cdiv(triton.cdiv(max_len, wanted), block_n) * block_n
    splits = triton.cdiv(max_len, split_len)  # none entirely past max_len
    group = num_heads // kv_heads
    o = out if splits == 1 else torch.empty((n, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, num_heads, splits), dtype=torch.float32, device=q.device)
    _split_kernel[(n, kv_heads, splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, *k_cache.stride()[:3], *v_cache.stride()[:3],
        slot_ids, positions, max_len, split_len, o, lse, scale * _LOG2E,
        GROUP=group, BG=max(16, triton.next_power_of_2(group)), BN=block_n, D=head_dim,
        WIDEN=interpreting() and q.dtype == torch.bfloat16, num_warps=8)
    if splits > 1:
        _combine_kernel[(n, num_heads)](o, lse, positions, max_len, split_len, splits, out, D=head_dim,
                                        num_warps=1 if head_dim <= 128 else 2)
    return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
           positions: torch.Tensor) -> tuple[int, int, int]:
    device = q.device
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_device(name, t, device)
        if t.dtype not in FLOAT_DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{name}: expected the dtype of q, one of {FLOAT_DTYPES}, got {t.dtype}")
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q: expected [n, num_heads, head_dim] with contiguous rows, got {tuple(q.shape)} "
                         f"strides {q.stride()}")
    n, num_heads, head_dim = q.shape
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"q: head_dim must be a power of two in [16, 256], got {head_dim}")
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache: expected [num_slots, kv_heads, max_len, {head_dim}] with contiguous rows, "
                         f"got {tuple(k_cache.shape)} strides {k_cache.stride()}")
    if v_cache.shape != k_cache.shape or v_cache.stride(3) != 1:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)} with contiguous rows, "
                         f"got {tuple(v_cache.shape)} strides {v_cache.stride()}")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if kv_heads == 0 or num_heads % kv_heads or max_len == 0:
        raise ValueError(f"k_cache: {kv_heads} kv heads and {max_len} positions do not serve {num_heads} heads")
    check_vector("slot_ids", slot_ids, n, INDEX_DTYPES, device)
    check_vector("positions", positions, n, INDEX_DTYPES, device)
    return n, num_heads, head_dim


@triton.jit
def _write_kv_kernel(k, v, k_s0, k_s1, v_s0, v_s1, k_cache, v_cache, c_s0, c_s1, c_s2, num_slots, slot_ids,
                     positions, max_len, head_dim, BLOCK: tl.constexpr):
    # program (token, kv head): its key and value rows into (slot, head, position) of both caches
    token, head = tl.program_id(0), tl.program_id(1)
    # NOTE: slots and positions in range are the caller's invariant; the clamps keep a bad one inside
    slot = tl.minimum(tl.maximum(tl.load(slot_ids + token).to(tl.int64), 0), num_slots - 1)
    cols = tl.arange(0, BLOCK)
    in_row = cols < head_dim
    dst = slot * c_s0 + head * c_s1 + _last_position(positions, token, max_len) * c_s2 + cols
    tl.store(k_cache + dst, tl.load(k + token.to(tl.int64) * k_s0 + head * k_s1 + cols, mask=in_row), mask=in_row)
    tl.store(v_cache + dst, tl.load(v + token.to(tl.int64) * v_s0 + head * v_s1 + cols, mask=in_row), mask=in_row)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v `[n, kv_heads, head_dim]` (head_dim contiguous, any other strides) stored at (slot_ids[i],
    positions[i]) of the caches `[num_slots, kv_heads, max_len, head_dim]` (one layer, the same strides):
    one launch for both. (slot, position) pairs are distinct (a decode or prefill batch)."""
    device = k_cache.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        check_device(name, t, device)
        if t.dtype != k_cache.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {k_cache.dtype} with contiguous rows, got {t.dtype} "
                             f"strides {t.stride()}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache: expected the shape and strides of k_cache, got {tuple(v_cache.shape)} "
                         f"{v_cache.stride()} and {tuple(k_cache.shape)} {k_cache.stride()}")
    num_slots, kv_heads, max_len, head_dim = k_cache.shape
    n = k.shape[0]
    if k.shape != (n, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k, v: expected [n, {kv_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
    check_vector("slot_ids", slot_ids, n, INDEX_DTYPES, device)
    check_vector("positions", positions, n, INDEX_DTYPES, device)
    if n:
        _write_kv_kernel[(n, kv_heads)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache, v_cache,
                                        *k_cache.stride()[:3], num_slots, slot_ids, positions, max_len, head_dim,
                                        BLOCK=triton.next_power_of_2(head_dim), num_warps=1)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                           positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: per token, the slot's keys up to its position, kv heads repeated, float32 softmax."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        slot, last = int(slot_ids[i]), int(positions[i])
        keys = k_cache[slot, :, :last + 1].float().repeat_interleave(group, dim=0)  # [heads, len, head_dim]
        values = v_cache[slot, :, :last + 1].float().repeat_interleave(group, dim=0)
        scores = (keys @ q[i].float()[:, :, None])[:, :, 0] * scale  # [heads, len]
        out[i] = (torch.softmax(scores, dim=-1)[:, None, :] @ values)[:, 0].to(q.dtype)
    return out
