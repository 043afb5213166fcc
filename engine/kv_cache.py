"""A contiguous KV cache: one slot of `max_len` positions per running sequence."""

from __future__ import annotations

import torch

from ops.fused import write_kv


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: `[tokens, kv_heads, head_dim]` stored at (slot, position) of each token."""
        write_kv(self.k[layer], self.v[layer], slot_ids, positions, k, v)

    def window(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every slot (views): `[slots, kv_heads, length, head_dim]`."""
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def sequence(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's first `length` positions (a view): `[kv_heads, length, head_dim]`."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]
