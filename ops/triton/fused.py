"""Fused small kernels of a decode step: RMSNorm (with the residual add), a post-normed block's end with the next
block's norms, a dense FFN's gated activation, q/k norm + rotary embedding,
and router softmax + top-k + renormalisation, each one launch instead of 5-8 torch ops.

Each launcher `f` has its torch reference `f_torch`, with the same signature, in ops/fused.py (the
engine calls the dispatchers there). The kernels compute in float32 and round once to the input
dtype, where the references round after several ops: float32 inputs agree to float32 rounding,
bf16/fp16 to 1-2 ulps. The residual sum of `add_rms_norm` is rounded exactly as `x + update` is
(same bits). No host sync and grids from shapes only: every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.fused import KVWrite, RopeStyle
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_rows, check_vector
from ops.triton.gate_up import ACTIVATIONS, _activation

MAX_DIM = 16384  # one program holds a whole row
MAX_EXPERTS = 1024
MAX_TOP_K = 32


def _num_warps(block: int) -> int:
    # ~16 elements per thread; one warp reduces without shared memory (most decode rows are short)
    return max(1, min(16, block // 512))


# --- RMSNorm ------------------------------------------------------------------------------------------


@triton.jit
def _normed(v, w, dim, eps, DT: tl.constexpr):
    """weight * v / rms(v) of float32 `v` (0 beyond dim), rounded once to DT (every norm kernel's math)."""
    scale = tl.rsqrt(tl.sum(v * v, axis=0) / dim + eps)
    return (v * scale * w).to(DT).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x, x_stride, update, update_stride, weight, out, total, dim, eps,
                     HAS_UPDATE: tl.constexpr, BLOCK: tl.constexpr):
    # program (row); out and total are contiguous [rows, dim]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < dim
    v = tl.load(x + row * x_stride + cols, mask=in_row, other=0.0)
    if HAS_UPDATE:
        u = tl.load(update + row * update_stride + cols, mask=in_row, other=0.0)
        v = (v.to(tl.float32) + u.to(tl.float32)).to(out.dtype.element_ty)  # the bits of `x + update`
        tl.store(total + row * dim + cols, v, mask=in_row)
    w = tl.load(weight + cols, mask=in_row, other=0.0).to(tl.float32)
    DT = out.dtype.element_ty
    tl.store(out + row * dim + cols, _normed(v.to(tl.float32), w, dim, eps, DT).to(DT), mask=in_row)


def _as_rows(name: str, x: torch.Tensor, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """x `[..., dim]` as a `[rows, dim]` view (never a copy: the caller's bytes are read in place)."""
    check_device(name, x, device)
    if x.dim() < 1 or x.shape[-1] != dim or x.dtype != dtype:
        raise ValueError(f"{name}: expected [..., {dim}] of {dtype}, got {x.dtype} {tuple(x.shape)}")
    try:
        rows = x.view(-1, dim)
    except RuntimeError as e:
        raise ValueError(f"{name}: leading dimensions do not flatten without a copy, strides {x.stride()}") from e
    check_rows(name, rows, (rows.shape[0], dim), (dtype,), device)
    return rows


def _launch_norm(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    device = x.device
    check_device("x", x, device)
    if x.dim() < 1 or x.dtype not in FLOAT_DTYPES or not 1 <= x.shape[-1] <= MAX_DIM:
        raise ValueError(f"x: expected float [..., dim <= {MAX_DIM}], got {x.dtype} {tuple(x.shape)}")
    dim = x.shape[-1]
    check_vector("weight", weight, dim, (x.dtype,), device)
    rows = _as_rows("x", x, dim, x.dtype, device)
    updates = rows if update is None else _as_rows("update", update, dim, x.dtype, device)
    if update is not None and update.shape != x.shape:
        raise ValueError(f"update: expected the shape of x {tuple(x.shape)}, got {tuple(update.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    total = out if update is None else torch.empty(x.shape, dtype=x.dtype, device=device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows.stride(0), updates, updates.stride(0), weight, out, total,
                                           dim, float(eps), HAS_UPDATE=update is not None, BLOCK=block,
                                           num_warps=_num_warps(block))
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[..., dim]` (rows contiguous), weight `[dim]` of x's dtype -> weight * x / rms(x), x's dtype.
    A per-head norm is x `[tokens, heads, head_dim]` with weight `[head_dim]`."""
    return _launch_norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, rms_norm(x + update)): the residual add and the next norm in one pass."""
    return _launch_norm(x, update, weight, eps)


# --- a post-normed block's end (Gemma 4's sandwich) ---------------------------------------------------------


@triton.jit
def _sandwich_kernel(x, x_stride, a, a_stride, b, b_stride, wa, wb, wp, w1, w2, w3, y, o1, o2, o3, dim, eps, scale,
                     HAS_B: tl.constexpr, HAS_POST: tl.constexpr, SCALED: tl.constexpr, NEXT: tl.constexpr,
                     BLOCK: tl.constexpr):
    # program (row); y and o1..o3 are contiguous [rows, dim]. Each step rounds to the activation dtype where the
    # torch reference's op does, so that y has the bits of `x + s` (and `* scale`) for the same s.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < dim
    DT = y.dtype.element_ty
    weight = tl.load(wa + cols, mask=in_row, other=0.0).to(tl.float32)
    s = _normed(tl.load(a + row * a_stride + cols, mask=in_row, other=0.0).to(tl.float32), weight, dim, eps, DT)
    if HAS_B:
        weight = tl.load(wb + cols, mask=in_row, other=0.0).to(tl.float32)
        other = _normed(tl.load(b + row * b_stride + cols, mask=in_row, other=0.0).to(tl.float32), weight, dim, eps,
                        DT)
        s = (s + other).to(DT).to(tl.float32)
    if HAS_POST:
        s = _normed(s, tl.load(wp + cols, mask=in_row, other=0.0).to(tl.float32), dim, eps, DT)
    v = (tl.load(x + row * x_stride + cols, mask=in_row, other=0.0).to(tl.float32) + s).to(DT)
    if SCALED:
        v = (v.to(tl.float32) * scale).to(DT)
    tl.store(y + row * dim + cols, v, mask=in_row)
    v = v.to(tl.float32)
    if NEXT > 0:
        tl.store(o1 + row * dim + cols, _normed(v, tl.load(w1 + cols, mask=in_row, other=0.0).to(tl.float32), dim,
                                                eps, DT).to(DT), mask=in_row)
    if NEXT > 1:
        tl.store(o2 + row * dim + cols, _normed(v, tl.load(w2 + cols, mask=in_row, other=0.0).to(tl.float32), dim,
                                                eps, DT).to(DT), mask=in_row)
    if NEXT > 2:
        tl.store(o3 + row * dim + cols, _normed(v, tl.load(w3 + cols, mask=in_row, other=0.0).to(tl.float32), dim,
                                                eps, DT).to(DT), mask=in_row)


def sandwich_norm(x: torch.Tensor, a: torch.Tensor, a_weight: torch.Tensor, eps: float,
                  b: torch.Tensor | None = None, b_weight: torch.Tensor | None = None,
                  post_weight: torch.Tensor | None = None, scale: float = 1.0,
                  next_weights: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`ops.fused.sandwich_norm` in one launch: x, a, b `[..., dim]` of one float dtype (rows in place), weights
    `[dim]` of that dtype."""
    device = x.device
    check_device("x", x, device)
    if x.dim() < 1 or x.dtype not in FLOAT_DTYPES or not 1 <= x.shape[-1] <= MAX_DIM:
        raise ValueError(f"x: expected float [..., dim <= {MAX_DIM}], got {x.dtype} {tuple(x.shape)}")
    if len(next_weights) > 3 or (b is None) != (b_weight is None):
        raise ValueError(f"need at most 3 next weights and b with b_weight, got {len(next_weights)} and "
                         f"b {'given' if b is not None else 'missing'}, b_weight "
                         f"{'given' if b_weight is not None else 'missing'}")
    dim = x.shape[-1]
    rows = _as_rows("x", x, dim, x.dtype, device)
    inputs = {"a": a, "b": b}
    for name, t in inputs.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name}: expected the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    a_rows = _as_rows("a", a, dim, x.dtype, device)
    b_rows = a_rows if b is None else _as_rows("b", b, dim, x.dtype, device)
    weights = {"a_weight": a_weight, "b_weight": b_weight, "post_weight": post_weight,
               **{f"next_weights[{k}]": w for k, w in enumerate(next_weights)}}
    for name, w in weights.items():
        if w is not None:
            check_vector(name, w, dim, (x.dtype,), device)
    y = torch.empty(x.shape, dtype=x.dtype, device=device)
    outs = [torch.empty(x.shape, dtype=x.dtype, device=device) for _ in next_weights]
    if rows.shape[0]:
        # the kernel reads w1..w3 and writes o1..o3 only below NEXT: the slots past it take any tensor of the dtype
        next_slots = [*next_weights, *[a_weight] * (3 - len(next_weights))]
        out_slots = [*outs, *[y] * (3 - len(outs))]
        block = triton.next_power_of_2(dim)
        _sandwich_kernel[(rows.shape[0],)](
            rows, rows.stride(0), a_rows, a_rows.stride(0), b_rows, b_rows.stride(0), a_weight,
            a_weight if b_weight is None else b_weight, a_weight if post_weight is None else post_weight,
            *next_slots, y, *out_slots, dim, float(eps), float(scale),
            HAS_B=b is not None, HAS_POST=post_weight is not None, SCALED=scale != 1.0, NEXT=len(next_weights),
            BLOCK=block, num_warps=_num_warps(block))
    return y, outs


# --- a dense FFN's gated activation ------------------------------------------------------------------------

GATED_BLOCK = 1024  # columns a program


@triton.jit
def _gated_act_kernel(gate_up, stride, out, ff, ACT: tl.constexpr, BLOCK: tl.constexpr):
    # program (row, block of columns); out is contiguous [rows, ff]. The activation is rounded to the dtype before
    # the product, as the torch reference's two ops round
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < ff
    gate = tl.load(gate_up + row * stride + cols, mask=in_row, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride + ff + cols, mask=in_row, other=0.0).to(tl.float32)
    act = _activation(gate, 1.0, 0.0, 0.0, ACT).to(out.dtype.element_ty).to(tl.float32)  # the experts' formulas
    tl.store(out + row * ff + cols, (act * up).to(out.dtype.element_ty), mask=in_row)


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`ops.fused.gated_act` in one launch: gate_up `[tokens, 2 ff]` (rows contiguous) -> `[tokens, ff]`."""
    device = gate_up.device
    check_device("gate_up", gate_up, device)
    if activation not in ("silu", "gelu"):
        raise ValueError(f"activation: expected silu or gelu, got {activation!r}")
    if gate_up.dim() != 2 or gate_up.dtype not in FLOAT_DTYPES or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected float [tokens, 2 ff] with contiguous rows, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    ff = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], ff), dtype=gate_up.dtype, device=device)
    if gate_up.shape[0] and ff:
        _gated_act_kernel[(gate_up.shape[0], triton.cdiv(ff, GATED_BLOCK))](
            gate_up, gate_up.stride(0), out, ff, ACT=ACTIVATIONS[activation], BLOCK=GATED_BLOCK, num_warps=4)
    return out


# --- q/k norm + rotary embedding ----------------------------------------------------------------------


@triton.jit
def _qk_norm_rope_kernel(x, token_stride, head_stride, heads, weight, k_weight, q_heads, positions, inv_freq, out,
                         half, eps, v, v_token_stride, v_head_stride, k_cache, v_cache, slot_ids, cache_slot_stride,
                         cache_head_stride, cache_pos_stride, HAS_NORM: tl.constexpr, NEOX: tl.constexpr,
                         WRITE_KV: tl.constexpr, BLOCK: tl.constexpr):
    # program (token, head); out is contiguous [tokens, heads, 2 * half]; heads >= q_heads norm with k_weight; with
    # WRITE_KV a key head's program also stores its rotated key and the token's value head into the caches
    pid = tl.program_id(0)
    token = pid // heads
    is_key = pid % heads >= q_heads
    i = tl.arange(0, BLOCK)
    in_half = i < half
    if NEOX:  # pairs (i, i + half)
        first, second = i, i + half
    else:  # pairs (2i, 2i + 1)
        first, second = 2 * i, 2 * i + 1
    src = x + token.to(tl.int64) * token_stride + (pid % heads).to(tl.int64) * head_stride
    a = tl.load(src + first, mask=in_half, other=0.0).to(tl.float32)
    b = tl.load(src + second, mask=in_half, other=0.0).to(tl.float32)
    if HAS_NORM:
        scale = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * half) + eps)
        wa = tl.where(is_key, tl.load(k_weight + first, mask=in_half, other=0.0),
                      tl.load(weight + first, mask=in_half, other=0.0))
        wb = tl.where(is_key, tl.load(k_weight + second, mask=in_half, other=0.0),
                      tl.load(weight + second, mask=in_half, other=0.0))
        a = a * scale * wa.to(tl.float32)
        b = b * scale * wb.to(tl.float32)
    # the engine's angles: positions.float() * inv_freq, one float32 rounding
    position = tl.load(positions + token)
    angle = position.to(tl.float32) * tl.load(inv_freq + i, mask=in_half, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    rotated_a = (a * cos - b * sin).to(out.dtype.element_ty)
    rotated_b = (b * cos + a * sin).to(out.dtype.element_ty)
    dst = out + pid.to(tl.int64) * (2 * half)
    tl.store(dst + first, rotated_a, mask=in_half)
    tl.store(dst + second, rotated_b, mask=in_half)
    if WRITE_KV:
        kv_head = (pid % heads - q_heads).to(tl.int64)
        row = tl.load(slot_ids + token).to(tl.int64) * cache_slot_stride + kv_head * cache_head_stride + \
            position.to(tl.int64) * cache_pos_stride
        mask = in_half & (i * 0 + pid % heads >= q_heads)  # a key head's program
        tl.store(k_cache + row + first, rotated_a, mask=mask)
        tl.store(k_cache + row + second, rotated_b, mask=mask)
        v_src = v + token.to(tl.int64) * v_token_stride + kv_head * v_head_stride
        tl.store(v_cache + row + first, tl.load(v_src + first, mask=mask, other=0.0), mask=mask)
        tl.store(v_cache + row + second, tl.load(v_src + second, mask=mask, other=0.0), mask=mask)


def qk_norm_rope(x: torch.Tensor, norm_weight: torch.Tensor | None, positions: torch.Tensor,
                 inv_freq: torch.Tensor, style: RopeStyle, eps: float, k_norm_weight: torch.Tensor | None = None,
                 q_heads: int | None = None, cache: KVWrite | None = None) -> torch.Tensor:
    """x `[tokens, heads, head_dim]` (head_dim contiguous, any token/head strides) -> the same shape,
    contiguous: optional per-head RMSNorm (norm_weight `[head_dim]` of x's dtype), then rotary embedding
    at `positions` (int `[tokens]`) with `inv_freq` (float32 `[head_dim / 2]`), neox or normal pairs.
    q and k of a fused projection in one launch: heads from `q_heads` on are keys, normed with
    `k_norm_weight` (given with norm_weight). `cache`: the rotated keys and the values stored into one layer's
    unquantized caches in the same launch (what `write_kv` would store)."""
    device = x.device
    check_device("x", x, device)
    if x.dim() != 3 or x.dtype not in FLOAT_DTYPES or x.shape[2] % 2 or not 2 <= x.shape[2] <= MAX_DIM:
        raise ValueError(f"x: expected float [tokens, heads, even head_dim], got {x.dtype} {tuple(x.shape)}")
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1:
        raise ValueError(f"x: head_dim must be contiguous, got strides {x.stride()}")
    if style not in ("neox", "normal"):
        raise ValueError(f"style: expected 'neox' or 'normal', got {style!r}")
    if norm_weight is not None:
        check_vector("norm_weight", norm_weight, head_dim, (x.dtype,), device)
    if (k_norm_weight is None) != (norm_weight is None or q_heads is None) or not 0 <= (q_heads or 0) <= heads:
        raise ValueError(f"k_norm_weight and q_heads (<= {heads}): both with norm_weight, or neither; "
                         f"got {k_norm_weight is not None} and {q_heads}")
    if k_norm_weight is not None:
        check_vector("k_norm_weight", k_norm_weight, head_dim, (x.dtype,), device)
    check_vector("positions", positions, tokens, INDEX_DTYPES, device)
    check_vector("inv_freq", inv_freq, head_dim // 2, (torch.float32,), device)
    if cache is not None:
        check_kv_write(cache, x, tokens, heads - (heads if q_heads is None else q_heads))
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=device)
    if tokens and heads:
        block = triton.next_power_of_2(head_dim // 2)
        weight = x if norm_weight is None else norm_weight
        c = cache or KVWrite(out, out, positions, out)  # unused pointers without a cache
        cache_strides = c.k_cache.stride()[:3] if cache is not None else (0, 0, 0)
        _qk_norm_rope_kernel[(tokens * heads,)](
            x, x.stride(0), x.stride(1), heads, weight, weight if k_norm_weight is None else k_norm_weight,
            heads if q_heads is None else q_heads, positions, inv_freq, out, head_dim // 2, float(eps),
            c.v, c.v.stride(0), c.v.stride(1), c.k_cache, c.v_cache, c.slot_ids, *cache_strides,
            HAS_NORM=norm_weight is not None, NEOX=style == "neox", WRITE_KV=cache is not None, BLOCK=block,
            num_warps=_num_warps(block))
    return out


def check_kv_write(cache: KVWrite, x: torch.Tensor, tokens: int, kv_heads: int) -> None:
    """The caches `[slots, kv_heads, max_len, head_dim]` of x's dtype, one layout for K and V (head_dim contiguous),
    v `[tokens, kv_heads, head_dim]` (head_dim contiguous), slot ids `[tokens]`."""
    head_dim, device = x.shape[2], x.device
    for name, t in (("k_cache", cache.k_cache), ("v_cache", cache.v_cache)):
        check_device(name, t, device)
        if t.dim() != 4 or t.dtype != x.dtype or t.shape[1] != kv_heads or t.shape[3] != head_dim or t.stride(3) != 1:
            raise ValueError(f"{name}: expected {x.dtype} [slots, {kv_heads}, positions, {head_dim}] with contiguous "
                             f"rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if cache.v_cache.shape != cache.k_cache.shape or cache.v_cache.stride() != cache.k_cache.stride():
        raise ValueError(f"v_cache: expected the shape and strides of k_cache, got {tuple(cache.v_cache.shape)} "
                         f"{cache.v_cache.stride()} and {tuple(cache.k_cache.shape)} {cache.k_cache.stride()}")
    check_device("v", cache.v, device)
    if cache.v.shape != (tokens, kv_heads, head_dim) or cache.v.dtype != x.dtype or cache.v.stride(2) != 1:
        raise ValueError(f"v: expected {x.dtype} [{tokens}, {kv_heads}, {head_dim}] with contiguous rows, got "
                         f"{cache.v.dtype} {tuple(cache.v.shape)}")
    check_vector("slot_ids", cache.slot_ids, tokens, INDEX_DTYPES, device)


# --- routing --------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(logits, logits_stride, num_experts, given, given_stride, token_mask, ids_out, weights_out,
                  GIVEN: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (token); ids_out, weights_out are contiguous [tokens, TOP_K]
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    row = logits + token * logits_stride
    z = tl.load(row + e, mask=e < num_experts, other=-float("inf")).to(tl.float32)
    top = tl.max(z, axis=0)
    p = tl.exp(z - top)
    total = tl.sum(p, axis=0)
    k = tl.arange(0, BLOCK_K)
    if GIVEN:  # the softmax at given ids; an id out of range gets id -1 and weight 0
        ids = tl.load(given + token * given_stride + k, mask=k < TOP_K, other=-1).to(tl.int64)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1)
        zk = tl.load(row + ids, mask=ids >= 0, other=-float("inf")).to(tl.float32)
        w = tl.exp(zk - top) / total
    else:  # top-k by repeated argmax (the lowest id on ties); taken and padding lanes drop below 0
        work = tl.where(e < num_experts, p / total, -1.0)
        ids = tl.full([BLOCK_K], -1, tl.int64)
        w = tl.zeros([BLOCK_K], tl.float32)
        for j in tl.static_range(TOP_K):
            best, at = tl.max(work, axis=0, return_indices=True)
            ids = tl.where(k == j, at.to(tl.int64), ids)
            w = tl.where(k == j, best, w)
            work = tl.where(e == at, -2.0, work)
    if NORM:
        w = w / tl.sum(w, axis=0)
    if HAS_MASK:  # padding rows of a captured batch select no expert; their weights stay as computed
        ids = tl.where(tl.load(token_mask + token) != 0, ids, -1)
    tl.store(ids_out + token * TOP_K + k, ids, mask=k < TOP_K)
    tl.store(weights_out + token * TOP_K + k, w, mask=k < TOP_K)


def _launch_route(logits: torch.Tensor, top_k: int, given: torch.Tensor | None, norm_topk: bool,
                  token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    device = logits.device
    check_device("logits", logits, device)
    if logits.dim() != 2 or not 1 <= logits.shape[1] <= MAX_EXPERTS:
        raise ValueError(f"logits: expected [tokens, experts <= {MAX_EXPERTS}], got {tuple(logits.shape)}")
    tokens, num_experts = logits.shape
    check_rows("logits", logits, (tokens, num_experts), FLOAT_DTYPES, device)
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k: expected 1..{min(num_experts, MAX_TOP_K)}, got {top_k}")
    if given is not None:
        check_rows("expert_ids", given, (tokens, top_k), INDEX_DTYPES, device)
    if token_mask is not None:
        check_vector("token_mask", token_mask, tokens, (torch.bool,), device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    if tokens:
        block = triton.next_power_of_2(num_experts)
        _route_kernel[(tokens,)](
            logits, logits.stride(0), num_experts, ids if given is None else given,
            top_k if given is None else given.stride(0), ids if token_mask is None else token_mask, ids, weights,
            GIVEN=given is not None, NORM=bool(norm_topk), HAS_MASK=token_mask is not None, TOP_K=top_k,
            BLOCK_E=block, BLOCK_K=triton.next_power_of_2(top_k), num_warps=_num_warps(block))
    return ids, weights


def route_topk(logits: torch.Tensor, top_k: int, norm_topk: bool,
               token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[tokens, experts]` (float, rows contiguous) -> (expert ids int64, float32 weights)
    `[tokens, top_k]`: softmax over all experts, top-k in descending weight order, optionally
    renormalised to sum 1; rows where token_mask (bool `[tokens]`) is False get ids -1."""
    return _launch_route(logits, top_k, None, norm_topk, token_mask)


def routed_weights(logits: torch.Tensor, expert_ids: torch.Tensor, norm_topk: bool,
                   token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for given expert ids `[tokens, top_k]` (int32/int64; a routing trace): the softmax at
    those ids. Ids out of range (e.g. -1) get id -1 and weight 0, and are left out of the renormalisation."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids: expected [tokens, top_k], got {tuple(expert_ids.shape)}")
    return _launch_route(logits, expert_ids.shape[1], expert_ids, norm_topk, token_mask)
