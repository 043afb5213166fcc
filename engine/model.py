"""The transformer forward: token ids, positions and a KV cache in, logits out. Only math."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache
from engine.layers import rms_norm, swiglu
from engine.moe import ExpertExecutor, moe_forward
from engine.weights import Attention, DenseFFN, ModelWeights


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
    logit_rows: torch.Tensor  # [seqs] row of each sequence's last token
    kv_length: int  # decode attention reads this many positions of each slot (>= every position + 1)
    token_mask: torch.Tensor | None = None  # [tokens] bool; False rows (padding) route to no expert

    @classmethod
    def build(cls, spans: list[SeqSpan], token_ids: list[list[int]], device: torch.device) -> ForwardBatch:
        ids = [t for seq in token_ids for t in seq]
        positions = [p for s in spans for p in range(s.start, s.end)]
        slots = [s.slot for s in spans for _ in range(s.num_tokens)]
        rows = [sum(s.num_tokens for s in spans[:i + 1]) - 1 for i in range(len(spans))]
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), tuple(spans), as_tensor(rows),
                   max(s.end for s in spans))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def is_decode(self) -> bool:
        return all(s.num_tokens == 1 for s in self.spans)


class Rope:
    def __init__(self, head_dim: int, theta: float, scale: float, style: str, device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponents) / scale  # [head_dim / 2]
        self.style = style

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [tokens, head_dim / 2]
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if self.style == "neox":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class Model:
    def __init__(self, weights: ModelWeights, experts: ExpertExecutor) -> None:
        self.w, self.hp, self.arch, self.experts = weights, weights.hparams, weights.arch, experts
        hp = self.hp
        self.rope = Rope(hp.head_dim, hp.rope_theta, hp.rope_scale, self.arch.rope_style, weights.embed.device)
        self.scale = hp.head_dim ** -0.5

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, routing: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each sequence's last token: float32 `[num_seqs, vocab]`.

        `routing` (`[num_moe_layers, tokens, top_k]`) replaces the routers' choice of experts.
        """
        x = self.w.embed[batch.input_ids]  # [tokens, hidden]
        cos, sin = self.rope.tables(batch.positions)
        moe_index = 0
        for i, layer in enumerate(self.w.layers):
            h = rms_norm(x, layer.attn_norm, self.hp.rms_eps)
            x = x + self.attention(i, layer.attn, h, batch, kv, cos, sin)
            h = rms_norm(x, layer.ffn_norm, self.hp.rms_eps)
            if isinstance(layer.ffn, DenseFFN):
                x = x + swiglu(h, layer.ffn)
                continue
            routed = routing[moe_index] if routing is not None else None
            x = x + moe_forward(i, h, layer.ffn, self.hp, self.experts, routed, batch.token_mask)
            moe_index += 1
        x = rms_norm(x[batch.logit_rows], self.w.norm, self.hp.rms_eps)
        return F.linear(x, self.w.output).float()

    def attention(self, i: int, a: Attention, x: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hp, n = self.hp, x.shape[0]
        q, k, v = F.linear(x, a.q, a.q_bias), F.linear(x, a.k, a.k_bias), F.linear(x, a.v, a.v_bias)
        if self.arch.qk_norm == "full":
            q, k = rms_norm(q, a.q_norm, hp.rms_eps), rms_norm(k, a.k_norm, hp.rms_eps)
        q = q.view(n, hp.num_heads, hp.head_dim)
        k = k.view(n, hp.num_kv_heads, hp.head_dim)
        v = v.view(n, hp.num_kv_heads, hp.head_dim)
        if self.arch.qk_norm == "head":
            q, k = rms_norm(q, a.q_norm, hp.rms_eps), rms_norm(k, a.k_norm, hp.rms_eps)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        kv.write(i, batch.slot_ids, batch.positions, k, v)
        attend = self.decode_attention if batch.is_decode else self.prefill_attention
        out = attend(i, q, batch, kv)  # [tokens, heads, head_dim]
        return F.linear(out.reshape(n, -1), a.o)

    def decode_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        length = batch.kv_length
        keys, values = kv.gather(i, batch.slot_ids, length)  # [seqs, kv_heads, length, head_dim]
        mask = torch.arange(length, device=q.device)[None, :] <= batch.positions[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :],
                                             scale=self.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def prefill_attention(self, i: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        outs, row = [], 0
        for span in batch.spans:
            keys, values = kv.sequence(i, span.slot, span.end)  # [kv_heads, end, head_dim]
            q_seq = q[row:row + span.num_tokens].transpose(0, 1)  # [heads, tokens, head_dim]
            query_pos = torch.arange(span.start, span.end, device=q.device)
            mask = torch.arange(span.end, device=q.device)[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(q_seq[None], keys[None], values[None], attn_mask=mask,
                                                 scale=self.scale, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
            row += span.num_tokens
        return torch.cat(outs)
