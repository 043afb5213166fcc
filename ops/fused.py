"""The small per-layer operations of the forward pass (RMSNorm with the residual add, a post-normed block's end with
the next block's norms, a dense FFN's gated activation, q/k norm + rotary
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
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from ops.kv_quant import dense, latent_value_dim, quantize_rows, row_bytes
from ops.quants import QType
from ops.qweight import Q8Weight

RopeStyle = Literal["neox", "normal"]


class KVWrite(NamedTuple):
    """Where `qk_norm_rope` also stores a step's keys and values: one layer's unquantized caches
    `[slots, kv_heads, max_len, head_dim]`, each token's slot and its values `[tokens, kv_heads, head_dim]`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_ids: torch.Tensor
    v: torch.Tensor


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


def linear(x: torch.Tensor, w: torch.Tensor | Q8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias): W a tensor, or a dense matrix kept as Q8_0 (`ops.qweight`), read as it is where the kernel
    runs."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if _fused(x):
        from ops.triton.qlinear import q8_linear
        return q8_linear(x, w, bias)
    return F.linear(x, w.dequantize(x.dtype), bias)


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


def sandwich_norm(x: torch.Tensor, a: torch.Tensor, a_weight: torch.Tensor, eps: float,
                  b: torch.Tensor | None = None, b_weight: torch.Tensor | None = None,
                  post_weight: torch.Tensor | None = None, scale: float = 1.0,
                  next_weights: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The end of a post-normed block (Gemma 4's "sandwich") and the norms the next block reads, in one pass:
    s = rms_norm(a) (+ rms_norm(b)), then rms_norm(s) with post_weight where given; y = (x + s) * scale; returns
    (y, [rms_norm(y, w) for w in next_weights]) (at most 3). x, a, b `[tokens, dim]`."""
    if _fused(x):
        from ops.triton import fused
        return fused.sandwich_norm(x, a, a_weight, eps, b, b_weight, post_weight, scale, next_weights)
    return sandwich_norm_torch(x, a, a_weight, eps, b, b_weight, post_weight, scale, next_weights)


def gated_act(gate_up: torch.Tensor, activation: Literal["silu", "gelu"]) -> torch.Tensor:
    """`act(gate) * up` of a dense FFN's stacked projection `[tokens, 2 ff]` (gate, then up) -> `[tokens, ff]`:
    SiLU, or GELU in its tanh form."""
    if _fused(gate_up):
        from ops.triton import fused
        return fused.gated_act(gate_up, activation)
    return gated_act_torch(gate_up, activation)


def qk_norm_rope(x: torch.Tensor, norm_weight: torch.Tensor | None, positions: torch.Tensor,
                 inv_freq: torch.Tensor, style: RopeStyle, eps: float, k_norm_weight: torch.Tensor | None = None,
                 q_heads: int | None = None, cache: KVWrite | None = None) -> torch.Tensor:
    """x `[tokens, heads, head_dim]`: optional per-head RMSNorm, then rotary embedding at `positions`
    (neox: rotate halves; normal: rotate interleaved pairs). With q_heads, x holds q then k heads (of a
    fused projection) and the k heads are normed with k_norm_weight. With `cache` the rotated keys (the heads from
    q_heads on) and the values are also written into the caches, as `write_kv` writes them (one launch on the GPU)."""
    if cache is not None and q_heads is None:
        raise ValueError("qk_norm_rope: a cache write needs q_heads (the key heads follow the query heads)")
    if _fused(x):
        from ops.triton import fused
        return fused.qk_norm_rope(x, norm_weight, positions, inv_freq, style, eps, k_norm_weight, q_heads, cache)
    if q_heads is not None:
        out = torch.cat([qk_norm_rope_torch(x[:, :q_heads], norm_weight, positions, inv_freq, style, eps),
                         qk_norm_rope_torch(x[:, q_heads:], k_norm_weight, positions, inv_freq, style, eps)], dim=1)
    else:
        out = qk_norm_rope_torch(x, norm_weight, positions, inv_freq, style, eps)
    if cache is not None:
        write_kv_torch(cache.k_cache, cache.v_cache, cache.slot_ids, positions, out[:, q_heads or 0:], cache.v)
    return out


MLA_FUSED_TOKENS = 64  # a step of at most this many tokens projects MLA's q and latent in one launch (decode)


def mla_qk(q: torch.Tensor, kv: torch.Tensor, k_b: torch.Tensor, kv_norm: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor, style: RopeStyle, eps: float, rope_gain: float, cache: torch.Tensor,
           slot_ids: torch.Tensor) -> torch.Tensor:
    """Multi-head latent attention's query and cache entry (DeepSeek-V2/V3, `engine.arch.deepseek2`): q `[tokens,
    heads, nope + rope]` and kv `[tokens, kv_lora_rank + rope]` (the projections, any row strides) -> the query in the
    latent space `[tokens, heads, kv_lora_rank + rope]`: the nope part times the key decompression k_b `[heads,
    kv_lora_rank, nope]` (absorbed), the rope part rotated at `positions` and scaled by `rope_gain`. The token's entry
    (the RMS-normed latent with kv_norm `[kv_lora_rank]`, the rotated shared key) is stored at (slot, position) of the
    layer's latent cache `[slots, 1, max_len, kv_lora_rank + rope]`. One launch on the GPU for a decode step's
    tokens (at most `MLA_FUSED_TOKENS`); else the dispatched ops, as `mla_qk_torch`."""
    if _fused(q) and q.shape[0] <= MLA_FUSED_TOKENS:
        from ops.triton import mla
        return mla.mla_qk(q, kv, k_b, kv_norm, positions, inv_freq, style, eps, rope_gain, cache, slot_ids)
    return mla_qk_torch(q, kv, k_b, kv_norm, positions, inv_freq, style, eps, rope_gain, cache, slot_ids)


def mla_qk_torch(q: torch.Tensor, kv: torch.Tensor, k_b: torch.Tensor, kv_norm: torch.Tensor,
                 positions: torch.Tensor, inv_freq: torch.Tensor, style: RopeStyle, eps: float, rope_gain: float,
                 cache: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    rank, nope = k_b.shape[1], k_b.shape[2]
    q_nope, q_rot = q.split([nope, q.shape[2] - nope], dim=-1)
    q_rot = qk_norm_rope(q_rot, None, positions, inv_freq, style, eps)
    k_rot = qk_norm_rope(kv[:, None, rank:], None, positions, inv_freq, style, eps)
    q_latent = torch.einsum("nhd,hrd->nhr", q_nope, k_b)
    cache[slot_ids, :, positions] = torch.cat([rms_norm(kv[:, :rank], kv_norm, eps)[:, None], k_rot], dim=-1)
    return torch.cat([q_latent, q_rot if rope_gain == 1.0 else q_rot * rope_gain], dim=-1)


def mla_out(out: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """The latent attention's output `[tokens, heads, kv_lora_rank]` decompressed by v_b `[heads, v_dim,
    kv_lora_rank]` -> `[tokens, heads * v_dim]` (the output projection's input); one launch on the GPU for a decode
    step's tokens."""
    if _fused(out) and out.shape[0] <= MLA_FUSED_TOKENS:
        from ops.triton import mla
        return mla.mla_out(out, v_b)
    return mla_out_torch(out, v_b)


def mla_out_torch(out: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    return torch.einsum("nhr,hvr->nhv", out, v_b).reshape(out.shape[0], -1)


def route_topk(logits: torch.Tensor, top_k: int, norm_topk: bool,
               token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[tokens, experts]` -> expert ids (-1 where token_mask is False) and float32
    weights `[tokens, top_k]`: softmax over all experts, top-k, optionally renormalised."""
    if _fused(logits):
        from ops.triton import fused
        return fused.route_topk(logits, top_k, norm_topk, token_mask)
    return route_topk_torch(logits, top_k, norm_topk, token_mask)


def route_topk_scored(logits: torch.Tensor, top_k: int, norm_topk: bool, token_mask: torch.Tensor | None = None, *,
                      sigmoid: bool = False, score_bias: torch.Tensor | None = None, num_groups: int = 1,
                      topk_groups: int = 1, group_by_max: bool = False,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` for routers beyond softmax top-k (DeepSeek-V2/V3): scores by softmax or sigmoid over all
    experts; the choice made on scores + score_bias (float32 `[experts]`) among the experts of the best
    `topk_groups` of `num_groups` equal groups (a group scored by its best expert, or by its best two
    summed); the weights are the unbiased scores of the choice, optionally renormalised, times scale.
    Torch on every device (no host sync: a captured step can hold it)."""
    scores = _scores(logits, sigmoid)
    choice = scores if score_bias is None else scores + score_bias
    if num_groups > 1:
        choice = _best_groups(choice, num_groups, topk_groups, group_by_max)
    expert_ids = torch.topk(choice, top_k, dim=-1).indices
    weights = _normalize(scores.gather(-1, expert_ids), norm_topk)
    return _mask_ids(expert_ids, token_mask), weights if scale == 1.0 else weights * scale


def routed_weights_scored(logits: torch.Tensor, expert_ids: torch.Tensor, norm_topk: bool,
                          token_mask: torch.Tensor | None = None, *, sigmoid: bool = False,
                          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`routed_weights` for the routers of `route_topk_scored`: the weights they give the given ids."""
    expert_ids = expert_ids.to(logits.device, torch.int64)
    valid = (expert_ids >= 0) & (expert_ids < logits.shape[-1])
    scores = torch.where(valid, _scores(logits, sigmoid).gather(-1, expert_ids.clamp(0, logits.shape[-1] - 1)), 0.0)
    weights = _normalize(scores, norm_topk)
    return _mask_ids(torch.where(valid, expert_ids, -1), token_mask), weights if scale == 1.0 else weights * scale


def routed_weights(logits: torch.Tensor, expert_ids: torch.Tensor, norm_topk: bool,
                   token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for given expert ids (a routing trace replacing the router's choice)."""
    if _fused(logits):
        from ops.triton import fused
        return fused.routed_weights(logits, expert_ids, norm_topk, token_mask)
    return routed_weights_torch(logits, expert_ids, norm_topk, token_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int = 0, sinks: torch.Tensor | None = None, *,
                     k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    """q `[n, heads, head_dim]`; caches `[slots, kv_heads, length, row]` (a view of the first `length`
    positions; rows of q's dtype, or uint8 blocks of k_qtype / v_qtype): token i attends to positions
    0..positions[i] of slot slot_ids[i], the last `window` of them where window > 0. Values may be narrower
    than keys (a latent cache's view). sinks: float32 `[heads]`, each head's sink logit in the softmax
    (`attention`)."""
    if _fused(q) and _fits_attention_kernel(q, k_cache, v_cache, k_qtype, v_qtype, max_head_dim=512):
        from ops.triton.attention import decode_attention as fused_attention
        return fused_attention(q, k_cache, v_cache, slot_ids, positions, scale, k_qtype=k_qtype, v_qtype=v_qtype,
                               window=window, sinks=sinks)
    return decode_attention_sdpa(q, k_cache, v_cache, slot_ids, positions, scale, window, sinks, k_qtype=k_qtype,
                                 v_qtype=v_qtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int,
                      scale: float, window: int = 0, sinks: torch.Tensor | None = None, *,
                      k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    """Causal attention of one sequence's chunk: q `[n, heads, head_dim]` at positions start..start+n-1 of
    slot `slot` of one layer's caches `[slots, kv_heads, length, row]` (length at least start+n); token i
    attends to 0..start+i (the last `window` of them where window > 0); sinks as in `decode_attention`."""
    quantized = k_qtype is not None or v_qtype is not None  # unquantized: SDPA's flash kernels
    if (quantized and _fused(q) and _fits_attention_kernel(q, k_cache, v_cache, k_qtype, v_qtype) and not window
            and sinks is None):
        from ops.triton.attention import prefill_attention as fused_prefill
        return fused_prefill(q, k_cache, v_cache, slot, start, scale, k_qtype, v_qtype)
    return prefill_attention_sdpa(q, k_cache, v_cache, slot, start, scale, window, sinks, k_qtype=k_qtype,
                                  v_qtype=v_qtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None, sequence: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a sequence's first chunk over its own keys and values: q `[n, heads, head_dim]`, k and v
    `[n, kv_heads, head_dim]` at positions 0..n-1 -> `[n, heads, head_dim]` (what `prefill_attention` gives at
    start 0 from a cache holding k and v unquantized). Rows after a shorter sequence only see it and themselves.
    `sequence` `[n]` (on q's device): the rows are the first chunks of several sequences one after another, row i
    of sequence[i], each attending to its own: one launch for all (a step of prompts that came in together)."""
    n = q.shape[0]
    mask = causal_mask(torch.arange(n, device=q.device), n, window)
    if sequence is not None:
        mask &= sequence[:, None] == sequence[None, :]
    out = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, sinks)
    return out[0].transpose(0, 1)


def _fits_attention_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_qtype: QType | None,
                           v_qtype: QType | None, max_head_dim: int = 256) -> bool:
    """The Triton kernels' shapes: one head size for q, k and v, a power of two in [16, max_head_dim] (the caches'
    rows that many values, or their quantized bytes; decode takes Gemma 4's 512); or a latent cache (unquantized,
    values narrower than the keys, both parts powers of two: MLA's 512 + 64)."""
    head_dim = q.shape[-1]
    value_dim = latent_value_dim(head_dim, v_cache, k_qtype, v_qtype)
    rope = head_dim - value_dim
    if not _is_pow2_in(value_dim, max_head_dim) or (rope and not _is_pow2_in(rope, max_head_dim)) or \
            k_cache.shape[:-1] != v_cache.shape[:-1]:
        return False
    return all(cache.shape[-1] == (dim if qtype is None else row_bytes(qtype, dim, q.dtype))
               for cache, qtype, dim in ((k_cache, k_qtype, head_dim), (v_cache, v_qtype, value_dim)))


def _is_pow2_in(dim: int, largest: int) -> bool:
    return 16 <= dim <= largest and dim & (dim - 1) == 0


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


def sandwich_norm_torch(x: torch.Tensor, a: torch.Tensor, a_weight: torch.Tensor, eps: float,
                        b: torch.Tensor | None = None, b_weight: torch.Tensor | None = None,
                        post_weight: torch.Tensor | None = None, scale: float = 1.0,
                        next_weights: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    total = rms_norm_torch(a, a_weight, eps)
    if b is not None:
        assert b_weight is not None, "b is normed with b_weight"
        total = total + rms_norm_torch(b, b_weight, eps)
    if post_weight is not None:
        total = rms_norm_torch(total, post_weight, eps)
    y = x + total
    if scale != 1.0:
        y = y * scale
    return y, [rms_norm_torch(y, w, eps) for w in next_weights]


def gated_act_torch(gate_up: torch.Tensor, activation: Literal["silu", "gelu"]) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


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


def _scores(logits: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    return torch.sigmoid(logits.float()) if sigmoid else torch.softmax(logits.float(), dim=-1)


def _best_groups(choice: torch.Tensor, num_groups: int, topk_groups: int, group_by_max: bool) -> torch.Tensor:
    """choice `[tokens, experts]` with the experts outside each token's best groups set to -inf."""
    grouped = choice.view(choice.shape[0], num_groups, -1)  # [tokens, groups, experts per group]
    if group_by_max:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [tokens, groups]
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)


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
                          positions: torch.Tensor, scale: float, window: int = 0,
                          sinks: torch.Tensor | None = None, *, k_qtype: QType | None = None,
                          v_qtype: QType | None = None) -> torch.Tensor:
    head_dim = q.shape[-1]
    keys = dense(k_cache[slot_ids], k_qtype, head_dim, q.dtype)  # [n, kv_heads, length, head_dim]
    values = dense(v_cache[slot_ids], v_qtype, head_dim, q.dtype)
    mask = causal_mask(positions, keys.shape[2], window)  # [n, length]
    return attention(q[:, :, None, :], keys, values, mask[:, None, None, :], scale, sinks)[:, :, 0, :]


def prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int,
                           scale: float, window: int = 0, sinks: torch.Tensor | None = None, *,
                           k_qtype: QType | None = None, v_qtype: QType | None = None) -> torch.Tensor:
    end, head_dim = start + q.shape[0], q.shape[-1]
    keys = dense(k_cache[slot, :, :end], k_qtype, head_dim, q.dtype)  # [kv_heads, end, head_dim]
    values = dense(v_cache[slot, :, :end], v_qtype, head_dim, q.dtype)
    mask = causal_mask(torch.arange(start, end, device=q.device), end, window)
    out = attention(q.transpose(0, 1)[None], keys[None], values[None], mask, scale, sinks)
    return out[0].transpose(0, 1)


def causal_mask(query_positions: torch.Tensor, length: int, window: int = 0) -> torch.Tensor:
    """bool `[queries, length]`: what each query position attends to (the last `window` positions up to its
    own where window > 0)."""
    keys = torch.arange(length, device=query_positions.device)[None, :]
    mask = keys <= query_positions[:, None]
    return mask & (keys > query_positions[:, None] - window) if window else mask


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[b, heads, queries, d]`, keys and values `[b, kv_heads, length, d]`, mask bool broadcast to
    `[b, heads, queries, length]` -> `[b, heads, queries, value d]`. sinks float32 `[heads]`: a logit per head
    that joins each softmax and takes its share of the weight, adding nothing (gpt-oss)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1).float(), values.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)
