"""The small per-layer operations of the forward pass (RMSNorm with the residual add, q/k norm + rotary
embedding, router top-k, attention over the KV cache and its write), each with its torch reference.

On CUDA with Triton each is one fused launch (`ops/triton/fused.py`, `ops/triton/attention.py`)
instead of 5-8 torch ops: a decode step issues a few dozen launches per layer, and at batch 1 their
count, not their bytes, sets the time. Elsewhere the torch references run. The references are the
engine's semantics: float32 norms rounded to the activation dtype, rope applied in the activation
dtype, softmax over all experts in float32.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from ops.kv_quant import dense, quantize_rows
from ops.quants import QType

RopeStyle = Literal["neox", "normal"]


@cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _fused(x: torch.Tensor) -> bool:
    # NOTE: under Triton's interpreter (TRITON_INTERPRET=1) the kernels run on CPU tensors too
    return (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and _has_triton()


# --- dispatch -------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (also per head: x `[tokens, heads, head_dim]`)."""
    if _fused(x):
        from ops.triton import fused
        return fused.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, rms_norm(x + update)): the residual add and the next norm."""
    if _fused(x):
        from ops.triton import fused
        return fused.add_rms_norm(x, update, weight, eps)
    return add_rms_norm_torch(x, update, weight, eps)


def qk_norm_rope(x: torch.Tensor, norm_weight: torch.Tensor | None, positions: torch.Tensor,
                 inv_freq: torch.Tensor, style: RopeStyle, eps: float, k_norm_weight: torch.Tensor | None = None,
                 q_heads: int | None = None) -> torch.Tensor:
    """x `[tokens, heads, head_dim]`: optional per-head RMSNorm, then rotary embedding at `positions`
    (neox: rotate halves; normal: rotate interleaved pairs). With q_heads, x holds q then k heads (of a
    fused projection) and the k heads are normed with k_norm_weight."""
    if _fused(x):
        from ops.triton import fused
        return fused.qk_norm_rope(x, norm_weight, positions, inv_freq, style, eps, k_norm_weight, q_heads)
    if q_heads is not None:
        return torch.cat([qk_norm_rope_torch(x[:, :q_heads], norm_weight, positions, inv_freq, style, eps),
                          qk_norm_rope_torch(x[:, q_heads:], k_norm_weight, positions, inv_freq, style, eps)], dim=1)
    return qk_norm_rope_torch(x, norm_weight, positions, inv_freq, style, eps)


def route_topk(logits: torch.Tensor, top_k: int, norm_topk: bool,
               token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[tokens, experts]` -> expert ids (-1 where token_mask is False) and float32
    weights `[tokens, top_k]`: softmax over all experts, top-k, optionally renormalised."""
    if _fused(logits):
        from ops.triton import fused
        return fused.route_topk(logits, top_k, norm_topk, token_mask)
    return route_topk_torch(logits, top_k, norm_topk, token_mask)


def routed_weights(logits: torch.Tensor, expert_ids: torch.Tensor, norm_topk: bool,
                   token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for given expert ids (a routing trace replacing the router's choice)."""
    if _fused(logits):
        from ops.triton import fused
        return fused.routed_weights(logits, expert_ids, norm_topk, token_mask)
    return routed_weights_torch(logits, expert_ids, norm_topk, token_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     positions: torch.Tensor, scale: float, k_qtype: QType | None = None,
                     v_qtype: QType | None = None) -> torch.Tensor:
    """q `[n, heads, head_dim]`; caches `[slots, kv_heads, length, row]` (a view of the first `length`
    positions; rows of q's dtype, or uint8 blocks of k_qtype / v_qtype): token i attends to positions
    0..positions[i] of slot slot_ids[i]."""
    if _fused(q):
        from ops.triton.attention import decode_attention as fused_attention
        return fused_attention(q, k_cache, v_cache, slot_ids, positions, scale, k_qtype=k_qtype, v_qtype=v_qtype)
    return decode_attention_sdpa(q, k_cache, v_cache, slot_ids, positions, scale, k_qtype, v_qtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int,
                      scale: float, k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    """Causal attention of one sequence's chunk: q `[n, heads, head_dim]` at positions start..start+n-1 of
    slot `slot` of one layer's caches `[slots, kv_heads, max_len, row]`; token i attends to 0..start+i."""
    if _fused(q) and (k_qtype is not None or v_qtype is not None):  # unquantized: SDPA's flash kernels
        from ops.triton.attention import prefill_attention as fused_prefill
        return fused_prefill(q, k_cache, v_cache, slot, start, scale, k_qtype, v_qtype)
    return prefill_attention_sdpa(q, k_cache, v_cache, slot, start, scale, k_qtype, v_qtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_qtype: QType | None = None, v_qtype: QType | None = None) -> None:
    """k, v `[tokens, kv_heads, head_dim]` into one layer's caches `[slots, kv_heads, max_len, row]` at
    (slot_ids[i], positions[i]), quantized to k_qtype / v_qtype blocks where given."""
    if _fused(k):
        from ops.triton.attention import write_kv as fused_write_kv
        fused_write_kv(k_cache, v_cache, slot_ids, positions, k, v, k_qtype, v_qtype)
    else:
        write_kv_torch(k_cache, v_cache, slot_ids, positions, k, v, k_qtype, v_qtype)


# --- torch references ------------------------------------------------------------------------------------


def write_kv_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, k_qtype: QType | None = None,
                   v_qtype: QType | None = None) -> None:
    k_cache[slot_ids, :, positions] = k if k_qtype is None else quantize_rows(k, k_qtype)
    v_cache[slot_ids, :, positions] = v if v_qtype is None else quantize_rows(v, v_qtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + update
    return total, rms_norm_torch(total, weight, eps)


def qk_norm_rope_torch(x: torch.Tensor, norm_weight: torch.Tensor | None, positions: torch.Tensor,
                       inv_freq: torch.Tensor, style: RopeStyle, eps: float) -> torch.Tensor:
    if norm_weight is not None:
        x = rms_norm_torch(x, norm_weight, eps)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    if style == "neox":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _mask_ids(expert_ids: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    return expert_ids if token_mask is None else torch.where(token_mask[:, None], expert_ids, -1)


def _normalize(weights: torch.Tensor, norm_topk: bool) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True) if norm_topk else weights


def route_topk_torch(logits: torch.Tensor, top_k: int, norm_topk: bool,
                     token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    return _mask_ids(expert_ids, token_mask), _normalize(weights, norm_topk)


def routed_weights_torch(logits: torch.Tensor, expert_ids: torch.Tensor, norm_topk: bool,
                         token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    expert_ids = expert_ids.to(logits.device, torch.int64)
    weights = _normalize(torch.softmax(logits.float(), dim=-1).gather(-1, expert_ids), norm_topk)
    return _mask_ids(expert_ids, token_mask), weights


def decode_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                          positions: torch.Tensor, scale: float, k_qtype: QType | None = None,
                          v_qtype: QType | None = None) -> torch.Tensor:
    head_dim = q.shape[-1]
    keys = dense(k_cache[slot_ids], k_qtype, head_dim, q.dtype)  # [n, kv_heads, length, head_dim]
    values = dense(v_cache[slot_ids], v_qtype, head_dim, q.dtype)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int,
                           scale: float, k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    end, head_dim = start + q.shape[0], q.shape[-1]
    keys = dense(k_cache[slot, :, :end], k_qtype, head_dim, q.dtype)  # [kv_heads, end, head_dim]
    values = dense(v_cache[slot, :, :end], v_qtype, head_dim, q.dtype)
    query_pos = torch.arange(start, end, device=q.device)
    mask = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
