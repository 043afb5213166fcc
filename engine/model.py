"""The transformer forward: token ids, positions and a KV cache in, logits out. Only math."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from engine.arch import deepseek2, gemma4
from engine.arch.base import YaRN
from engine.arch.deepseek2 import MLAttention
from engine.arch.gemma4 import GemmaAttention
from engine.kv_cache import KVCache
from engine.layer_split import LayerSplit
from engine.layers import swiglu, use_device
from engine.moe import ExpertExecutor, Router, TopKRouter, moe_forward
from engine.weights import Attention, DenseFFN, ModelWeights, MoE
from ops.fused import (
    add_rms_norm,
    chunk_attention,
    decode_attention,
    linear,
    prefill_attention,
    qk_norm_rope,
    rms_norm,
    sandwich_norm,
)


@dataclass(frozen=True)
class SeqSpan:
    slot: int  # KV-cache slot of the sequence
    start: int  # position of its first token in this batch
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_ids: torch.Tensor  # [tokens] int64, KV slot of each token
    spans: tuple[SeqSpan, ...]  # sequences in token order
    logit_rows: torch.Tensor  # rows whose logits are computed: each sequence's last token, or more on request
    kv_length: int  # decode attention reads this many positions of each slot (>= every position + 1)
    token_mask: torch.Tensor | None = None  # [tokens] bool; False rows (padding) route to no expert
    fresh: bool = False  # one sequence's first chunk (start 0), padded rows after it: it attends over its own k, v
    # where the spans after the leading one-token spans are several prompts' first chunks (start 0): the chunk of each
    # of their rows `[rows]` int64 (they attend over their own keys and values in one launch); else None
    first_chunks: torch.Tensor | None = None

    @classmethod
    def build(cls, spans: list[SeqSpan], token_ids: list[list[int]], device: torch.device,
              logits_from: list[int] | None = None) -> ForwardBatch:
        """`logits_from[i]`: the first position of sequence i whose logits are computed (default: its last
        token, which always is); rows come in token order."""
        ids = [t for seq in token_ids for t in seq]
        positions = [p for s in spans for p in range(s.start, s.end)]
        slots = [s.slot for s in spans for _ in range(s.num_tokens)]
        ends = [sum(s.num_tokens for s in spans[:i + 1]) for i in range(len(spans))]
        froms = logits_from or [s.end - 1 for s in spans]
        rows = [end - s.end + p for s, end, first in zip(spans, ends, froms, strict=True)
                for p in range(min(max(first, s.start), s.end - 1), s.end)]
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        chunks = spans[leading_singles(spans):]
        first_chunks = None if len(chunks) < 2 or any(s.start for s in chunks) else \
            as_tensor([c for c, s in enumerate(chunks) for _ in range(s.num_tokens)])
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), tuple(spans), as_tensor(rows),
                   max(s.end for s in spans), first_chunks=first_chunks)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        """The batch with its tensors on `device` (a split model's later devices)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(self, input_ids=move(self.input_ids), positions=move(self.positions),
                       slot_ids=move(self.slot_ids), logit_rows=move(self.logit_rows),
                       token_mask=None if self.token_mask is None else move(self.token_mask),
                       first_chunks=None if self.first_chunks is None else move(self.first_chunks))

    @cached_property
    def is_decode(self) -> bool:
        return all(s.num_tokens == 1 for s in self.spans)

    @cached_property
    def singles(self) -> int:
        """The leading spans of one token (sequences that decode in a step that also prefills)."""
        return leading_singles(self.spans)


def leading_singles(spans: Sequence[SeqSpan]) -> int:
    """How many spans of one token lead `spans`."""
    return next((n for n, s in enumerate(spans) if s.num_tokens != 1), len(spans))


def rope_frequencies(head_dim: int, theta: float, scale: float, device: torch.device,
                     yarn: YaRN | None = None) -> torch.Tensor:
    """Rotary inverse frequencies `[head_dim / 2]` (float32), linear position scaling or YaRN folded in."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if yarn is None:
        return inv_freq / scale
    # YaRN: the low frequencies interpolated (divided by the factor), the high ones kept, a linear ramp
    # between the dimensions that turn beta_slow and beta_fast times over the original context
    low, high = (head_dim * math.log(yarn.orig_context / (turns * 2 * math.pi)) / (2 * math.log(theta))
                 for turns in (yarn.beta_fast, yarn.beta_slow))
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    kept = 1 - ((dims - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / yarn.factor * (1 - kept) + inv_freq * kept


class Model:
    def __init__(self, weights: ModelWeights, experts: ExpertExecutor, router: Router | None = None,
                 split: LayerSplit | None = None) -> None:
        """split: the layers' devices where they are several (`load_weights` placed each layer on its own)."""
        self.w, self.hp, self.arch, self.experts = weights, weights.hparams, weights.arch, experts
        self.router: Router = router or TopKRouter.of(weights)
        # the first layer of each later device's range -> that device: where a step's activations are handed on
        self.handoffs = {r.start: torch.device(d) for r, d in zip(split.ranges[1:], split.devices[1:], strict=True)} \
            if split is not None else {}
        devices = [layer.attn_norm.device for layer in weights.layers]
        freqs = {d: self._rope_frequencies(d) for d in set(devices)}
        self.freqs = [freqs[d] for d in devices]  # per layer: its (inv_freq, swa_inv_freq), on its device
        # per layer but the last: the next layer's attention norm, which its fused residual add applies, on its device
        self.next_norms = [after.attn_norm.to(d) for after, d in zip(weights.layers[1:], devices, strict=False)]
        hp = self.hp
        # YaRN's cos/sin magnitude on both q and k: squared into the scores' rotary part
        self.rope_gain = hp.yarn.attn_factor ** 2 if hp.yarn is not None else 1.0
        self.scale = deepseek2.softmax_scale(hp) if hp.mla else \
            (self.arch.qk_scale or hp.head_dim ** -0.5) * self.rope_gain

    def _rope_frequencies(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary inverse frequencies of the full-attention and the sliding-window layers, on `device`."""
        hp = self.hp
        inv_freq = rope_frequencies(hp.rope_dim, hp.rope_theta, hp.rope_scale, device, hp.yarn)
        if self.w.rope_factors is not None:  # Gemma 4's proportional rope on its full-attention layers
            inv_freq = inv_freq / self.w.rope_factors.to(device)
        # sliding-window layers of another head size or rope base have their own frequencies
        swa_inv_freq = rope_frequencies(hp.swa_head_dim or hp.rope_dim, hp.swa_rope_theta or hp.rope_theta,
                                        hp.rope_scale, device, hp.yarn)
        return inv_freq, swa_inv_freq

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def stage_batches(self, batch: ForwardBatch) -> dict[int, ForwardBatch]:
        """The step's batch on each later device of a split model, by the first layer of its range (none: one
        device)."""
        return {first: batch.to(device) for first, device in self.handoffs.items()}

    def hand_off(self, first: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The step's activations to the device whose range starts at layer `first`, the current one from here on."""
        use_device(self.handoffs[first])
        return [t.to(self.handoffs[first], non_blocking=True) for t in tensors]

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @property
    def attends_chunks_alone(self) -> bool:
        """Whether a prompt's first chunk may attend over its own keys and values (`ForwardBatch.fresh`): every layer's
        attention plain (no shared KV layers, no latent cache) and its keys and values those the cache keeps."""
        return all(isinstance(layer.attn, Attention) and layer.sandwich is None for layer in self.w.layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits of the batch's logit rows (each sequence's last token unless built otherwise): float32
        `[rows, vocab]`."""
        eps, layers = self.hp.rms_eps, self.w.layers
        if self.handoffs:  # NOTE: a split model's kernels launch on each range's device in turn, the first's first
            use_device(self.device)
        x = self.w.embed[batch.input_ids]  # [tokens, hidden]
        if layers[0].sandwich is not None:
            return self.forward_sandwich(x, batch, kv)
        h = rms_norm(x, layers[0].attn_norm, eps)
        moe_index, batches = 0, self.stage_batches(batch)
        for i, layer in enumerate(layers):
            if i in batches:  # NOTE: the first layer of a device's range: the step continues on that device
                batch, (x, h) = batches[i], self.hand_off(i, x, h)
            # NOTE: each residual add is fused with the norm that follows it
            x, h = add_rms_norm(x, self.attention(i, layer.attn, h, batch, kv), layer.ffn_norm, eps)
            if isinstance(layer.ffn, DenseFFN):
                out = swiglu(h, layer.ffn)
            else:
                out = moe_forward(moe_index, i, h, layer.ffn, self.router, self.experts, batch.token_mask)
                moe_index += 1
            if i + 1 < len(layers):
                x, h = add_rms_norm(x, out, self.next_norms[i], eps)
            else:
                x = x + out
        return self.logits(x[batch.logit_rows])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(rms_norm(x, self.w.norm, self.hp.rms_eps), self.w.output).float()
        cap = self.hp.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def forward_sandwich(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Gemma 4: scaled embeddings, every block normed before and after (`engine.arch.gemma4`). Each block's end
        (its post-norms, the residual add, the layer's output scale) and the norms the next block reads are one
        `sandwich_norm`."""
        eps, moe_index, layers = self.hp.rms_eps, 0, self.w.layers
        x = x * self.hp.hidden ** 0.5
        h = rms_norm(x, layers[0].attn_norm, eps)
        batches = self.stage_batches(batch)
        for i, layer in enumerate(layers):
            if i in batches:  # NOTE: the first layer of a device's range: the step continues on that device
                batch, (x, h) = batches[i], self.hand_off(i, x, h)
            s, w = layer.sandwich, layer.ffn
            assert s is not None, "every layer of a sandwich-normed model has its norms"
            attn = self.attention(i, layer.attn, h, batch, kv)
            x, (h, *moe_inputs) = sandwich_norm(x, attn, s.post_attn_norm, eps,
                                                next_weights=gemma4.ffn_norms(layer.ffn_norm, w, s))
            following = (self.next_norms[i],) if i + 1 < len(layers) else ()
            if isinstance(w, MoE):
                assert s.mlp is not None and s.post_mlp_norm is not None and s.post_experts_norm is not None
                routed = moe_forward(moe_index, i, moe_inputs[0], w, self.router, self.experts, batch.token_mask,
                                     router_x=moe_inputs[1])
                moe_index += 1
                x, h_next = sandwich_norm(x, gemma4.gelu_mlp(h, s.mlp), s.post_mlp_norm, eps, routed,
                                          s.post_experts_norm, s.post_ffn_norm, s.out_scale, following)
            else:
                x, h_next = sandwich_norm(x, gemma4.gelu_mlp(h, w), s.post_ffn_norm, eps, scale=s.out_scale,
                                          next_weights=following)
            h = h_next[0] if h_next else h
        return self.logits(x[batch.logit_rows])

    def attention(self, i: int, a: Attention | MLAttention | GemmaAttention, x: torch.Tensor, batch: ForwardBatch,
                  kv: KVCache) -> torch.Tensor:
        inv_freq, swa_inv_freq = self.freqs[i]
        if isinstance(a, GemmaAttention):
            inv_freq = swa_inv_freq if self.hp.is_sliding(i) else inv_freq
            q, k, v = gemma4.project(a, x, batch.positions, inv_freq, self.hp.rms_eps)
            if k is not None:
                assert v is not None, "a layer that computes keys computes their values"
                kv.write(i, batch.slot_ids, batch.positions, k, v)
            # NOTE: a shared-KV layer reads the cache of a layer of its kind: the same window
            return linear(self.attend(self.hp.kv_layer(i), q, batch, kv, None).reshape(x.shape[0], -1), a.o)
        if isinstance(a, MLAttention):
            q = deepseek2.project_q(a, self.hp, x, batch.positions, inv_freq, self.rope_gain, kv.k[i],
                                    batch.slot_ids)
            return deepseek2.project_out(a, self.attend(i, q, batch, kv, None))
        hp, n = self.hp, x.shape[0]
        qkv = linear(x, a.qkv, a.qkv_bias)
        style, positions, eps = self.arch.rope_style, batch.positions, hp.rms_eps
        if self.arch.qk_norm == "full":
            assert a.q_norm is not None and a.k_norm is not None, "full q/k norm weights are loaded with the layer"
            q, k, v = a.split(qkv)
            q = qk_norm_rope(rms_norm(q, a.q_norm, eps).view(n, hp.num_heads, hp.head_dim), None, positions,
                             inv_freq, style, eps)
            k = qk_norm_rope(rms_norm(k, a.k_norm, eps).view(n, hp.num_kv_heads, hp.head_dim), None, positions,
                             inv_freq, style, eps)
            v = v.view(n, hp.num_kv_heads, hp.head_dim)
            kv.write(i, batch.slot_ids, batch.positions, k, v)
        else:  # q and k heads side by side in the projection: normed, rotated (and cached) in one launch
            heads = hp.num_heads + hp.num_kv_heads
            v = a.split(qkv)[2].view(n, hp.num_kv_heads, hp.head_dim)
            cache = kv.plain_write(i, batch.slot_ids, v)
            qk = qk_norm_rope(qkv[:, :heads * hp.head_dim].view(n, heads, hp.head_dim), a.q_norm, positions,
                              inv_freq, style, eps, a.k_norm if a.q_norm is not None else None,
                              hp.num_heads, cache)
            q, k = qk[:, :hp.num_heads], qk[:, hp.num_heads:]
            if cache is None:
                kv.write(i, batch.slot_ids, batch.positions, k, v)
        if batch.fresh:  # NOTE: the slot's keys are these (a captured chunk names no slot): read them as they are
            out = chunk_attention(q, k, v, self.scale, self.hp.window(i), a.sinks)
        else:
            out = self.attend(i, q, batch, kv, a.sinks, own=(k, v) if kv.qtypes == (None, None) else None)
        return linear(out.reshape(n, -1), a.o, a.o_bias)

    def attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, sinks: torch.Tensor | None,
               own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q `[tokens, heads, head_dim]` over the cached keys and values (the layer's window of them) ->
        `[tokens, heads, value dim]`. own: the step's keys and values as the cache keeps them (unquantized), which
        prompts' first chunks may attend over in place of the cache's (`prefill_attention`)."""
        if batch.is_decode:
            return self.decode_attention(i, q, batch, kv, sinks)
        return self.prefill_attention(i, q, batch, kv, sinks, own)

    def decode_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                         sinks: torch.Tensor | None) -> torch.Tensor:
        keys, values = kv.window(i, batch.kv_length)  # [slots, kv_heads, kv_length, row] views
        return decode_attention(q, keys, values, batch.slot_ids, batch.positions, self.scale, self.hp.window(i),
                                sinks, k_qtype=kv.k_qtype, v_qtype=kv.v_qtype)

    def prefill_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                          sinks: torch.Tensor | None, own: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
        """Each chunk of a prompt on its own; the leading run of one-token spans (the sequences that decode in a
        step that also prefills) in one decode launch: one launch a layer, not one a sequence (32 decoding
        streams made a step with a prompt chunk 7x as long as one without: H100, 2026-12-06). Several prompts'
        first chunks (`ForwardBatch.first_chunks`) over their own keys and values (`own`) in one launch too, as when
        many requests come in together (32 streams' prompts waited 430 ms for their first tokens in the server, a
        chunk at a time: H100, 2026-12-07)."""
        singles, together = batch.singles, own is not None and batch.first_chunks is not None
        outs, row = [], 0
        if singles > 1 or (singles and together):
            keys, values = kv.window(i, max(s.end for s in batch.spans[:singles]))
            outs.append(decode_attention(q[:singles], keys, values, batch.slot_ids[:singles],
                                         batch.positions[:singles], self.scale, self.hp.window(i), sinks,
                                         k_qtype=kv.k_qtype, v_qtype=kv.v_qtype))
            row = singles
        if together:
            assert own is not None, "first chunks together read the step's own keys and values"
            k, v = own
            outs.append(chunk_attention(q[row:], k[row:], v[row:], self.scale, self.hp.window(i), sinks,
                                        batch.first_chunks))
            return torch.cat(outs)
        for span in batch.spans[row:]:
            keys, values = kv.window(i, span.end)  # [slots, kv_heads, end, row] views
            outs.append(prefill_attention(q[row:row + span.num_tokens], keys, values, span.slot, span.start,
                                          self.scale, self.hp.window(i), sinks, k_qtype=kv.k_qtype,
                                          v_qtype=kv.v_qtype))
            row += span.num_tokens
        return torch.cat(outs)
