"""A contiguous KV cache: one slot of `max_len` positions per running sequence.

Each layer's keys and values are `[slots, kv_heads, max_len, head_dim]`. Layers of one shape are views of
one tensor; where layers differ (Gemma 4: wider heads and fewer KV heads in its full-attention layers,
nothing cached by its shared-KV layers) each layer has a tensor of its own."""

from __future__ import annotations

import torch

from engine.arch.base import HParams
from ops.fused import write_kv

LayerShape = tuple[int, int]  # (kv_heads, head_dim) of one layer's cache; 0 heads: the layer caches nothing


class KVCache:
    def __init__(self, shapes: list[LayerShape], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, latent_values: int = 0) -> None:
        """latent_values > 0: keys and values share one tensor (multi-head latent attention caches each token's
        latent once): the values are the keys' first `latent_values` columns."""
        self.num_slots, self.max_len, self.is_latent = num_slots, max_len, latent_values > 0
        new = lambda heads, dim, n: torch.zeros((n, num_slots, heads, max_len, dim), dtype=dtype, device=device)  # noqa: E731
        if len(set(shapes)) == 1:  # one tensor for all layers
            k = new(*shapes[0], len(shapes))
            v = k[..., :latent_values] if latent_values else new(*shapes[0], len(shapes))
            self.storage = [k] if latent_values else [k, v]
            self.k, self.v = list(k.unbind(0)), list(v.unbind(0))
        else:
            self.k = [new(heads, dim, 1)[0] for heads, dim in shapes]
            self.v = [new(heads, dim, 1)[0] for heads, dim in shapes]
            self.storage = self.k + self.v

    @classmethod
    def for_model(cls, hp: HParams, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        if hp.mla is not None:  # [latent, rotary key] per token and layer
            return cls([(1, hp.mla.latent_dim)] * hp.num_layers, num_slots, max_len, dtype, device,
                       hp.mla.kv_lora_rank)
        shapes = [(hp.kv_heads_of(i) if hp.kv_layer(i) == i else 0, hp.head_dim_of(i)) for i in range(hp.num_layers)]
        return cls(shapes, num_slots, max_len, dtype, device)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage)

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> None:
        """k, v: `[tokens, kv_heads, head_dim]` stored at (slot, position) of each token (v None: a latent cache)."""
        if self.is_latent:
            self.k[layer][slot_ids, :, positions] = k
        elif v is None:
            raise ValueError("a key/value cache needs the values too")
        else:
            write_kv(self.k[layer], self.v[layer], slot_ids, positions, k, v)

    def window(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every slot (views): `[slots, kv_heads, length, head_dim]`."""
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def sequence(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's first `length` positions (a view): `[kv_heads, length, head_dim]`."""
        return self.k[layer][slot, :, :length], self.v[layer][slot, :, :length]
