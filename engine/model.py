"""The transformer forward: token ids, positions and a KV cache in, logits out. Only math."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache
from engine.layers import swiglu
from engine.moe import ExpertExecutor, Router, TopKRouter, moe_forward
from engine.weights import Attention, DenseFFN, ModelWeights
from ops.fused import add_rms_norm, decode_attention, prefill_attention, qk_norm_rope, rms_norm


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
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), tuple(spans), as_tensor(rows),
                   max(s.end for s in spans))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def is_decode(self) -> bool:
        return all(s.num_tokens == 1 for s in self.spans)


def rope_frequencies(head_dim: int, theta: float, scale: float, device: torch.device) -> torch.Tensor:
    """Rotary inverse frequencies `[head_dim / 2]` (float32), linear position scaling folded in."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents) / scale


class Model:
    def __init__(self, weights: ModelWeights, experts: ExpertExecutor, router: Router | None = None) -> None:
        self.w, self.hp, self.arch, self.experts = weights, weights.hparams, weights.arch, experts
        self.router: Router = router or TopKRouter(self.hp.top_k, self.hp.norm_topk)
        hp = self.hp
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_theta, hp.rope_scale, weights.embed.device)
        self.scale = hp.head_dim ** -0.5

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits of the batch's logit rows (each sequence's last token unless built otherwise): float32
        `[rows, vocab]`."""
        eps, layers = self.hp.rms_eps, self.w.layers
        x = self.w.embed[batch.input_ids]  # [tokens, hidden]
        h = rms_norm(x, layers[0].attn_norm, eps)
        moe_index = 0
        for i, layer in enumerate(layers):
            # NOTE: each residual add is fused with the norm that follows it
            x, h = add_rms_norm(x, self.attention(i, layer.attn, h, batch, kv), layer.ffn_norm, eps)
            if isinstance(layer.ffn, DenseFFN):
                out = swiglu(h, layer.ffn)
            else:
                out = moe_forward(moe_index, i, h, layer.ffn, self.router, self.experts, batch.token_mask)
                moe_index += 1
            if i + 1 < len(layers):
                x, h = add_rms_norm(x, out, layers[i + 1].attn_norm, eps)
            else:
                x = x + out
        x = rms_norm(x[batch.logit_rows], self.w.norm, eps)
        return F.linear(x, self.w.output).float()

    def attention(self, i: int, a: Attention, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        hp, n = self.hp, x.shape[0]
        qkv = F.linear(x, a.qkv, a.qkv_bias)
        style, positions, eps = self.arch.rope_style, batch.positions, hp.rms_eps
        if self.arch.qk_norm == "full":
            assert a.q_norm is not None and a.k_norm is not None, "full q/k norm weights are loaded with the layer"
            q, k, v = a.split(qkv)
            q = qk_norm_rope(rms_norm(q, a.q_norm, eps).view(n, hp.num_heads, hp.head_dim), None, positions,
                             self.inv_freq, style, eps)
            k = qk_norm_rope(rms_norm(k, a.k_norm, eps).view(n, hp.num_kv_heads, hp.head_dim), None, positions,
                             self.inv_freq, style, eps)
        else:  # q and k heads side by side in the projection: normed and rotated in one launch
            heads = hp.num_heads + hp.num_kv_heads
            qk = qk_norm_rope(qkv[:, :heads * hp.head_dim].view(n, heads, hp.head_dim), a.q_norm, positions,
                              self.inv_freq, style, eps, a.k_norm if a.q_norm is not None else None,
                              hp.num_heads)
            q, k = qk[:, :hp.num_heads], qk[:, hp.num_heads:]
            v = a.split(qkv)[2]
        v = v.view(n, hp.num_kv_heads, hp.head_dim)
        kv.write(i, batch.slot_ids, batch.positions, k, v)
        attend = self.decode_attention if batch.is_decode else self.prefill_attention
        out = attend(i, q, batch, kv)  # [tokens, heads, head_dim]
        return F.linear(out.reshape(n, -1), a.o)

    def decode_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        keys, values = kv.window(i, batch.kv_length)  # [slots, kv_heads, kv_length, row] views
        return decode_attention(q, keys, values, batch.slot_ids, batch.positions, self.scale, *kv.qtypes)

    def prefill_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        outs, row = [], 0
        for span in batch.spans:
            keys, values = kv.window(i, span.end)  # [slots, kv_heads, end, row] views
            outs.append(prefill_attention(q[row:row + span.num_tokens], keys, values, span.slot, span.start,
                                          self.scale, *kv.qtypes))
            row += span.num_tokens
        return torch.cat(outs)
