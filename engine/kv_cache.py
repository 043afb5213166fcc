"""A contiguous KV cache: one slot of `max_len` positions per running sequence."""

from __future__ import annotations

import torch

from engine.arch.base import HParams
from ops.fused import write_kv


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, latent_values: int = 0) -> None:
        """latent_values > 0: keys and values share one tensor (multi-head latent attention caches each token's
        latent once): the values are the keys' first `latent_values` columns."""
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = self.k[..., :latent_values] if latent_values else torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len, self.is_latent = num_slots, max_len, latent_values > 0

    @classmethod
    def for_model(cls, hp: HParams, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        if hp.mla is not None:  # [latent, rotary key] per token and layer
            return cls(hp.num_layers, num_slots, max_len, 1, hp.mla.latent_dim, dtype, device, hp.mla.kv_lora_rank)
        return cls(hp.num_layers, num_slots, max_len, hp.num_kv_heads, hp.head_dim, dtype, device)

    @property
    def num_bytes(self) -> int:
        tensors = (self.k,) if self.is_latent else (self.k, self.v)
        return sum(t.numel() * t.element_size() for t in tensors)

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
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def sequence(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's first `length` positions (a view): `[kv_heads, length, head_dim]`."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]
