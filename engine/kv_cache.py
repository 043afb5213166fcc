"""A contiguous KV cache: one slot of `max_len` positions per running sequence.

K and V rows are kept in the activation dtype (`bf16`) or in ggml's q8_0 / q4_0 blocks (`ops.kv_quant`),
chosen separately for K and V: the write quantizes, the attention kernels dequantize as they read."""

from __future__ import annotations

import torch

from engine.arch.base import HParams
from ops.fused import write_kv
from ops.kv_quant import kv_qtype, row_bytes, zeros
from ops.quants import QType


def kv_dims(hp: HParams, max_num_seqs: int, max_context: int) -> tuple[int, int, int, int, int]:
    """(layers, slots, positions, kv heads, head_dim) of a model's cache: one slot per sequence, plus a
    scratch slot for the padding rows of captured batches; the context capped at the model's."""
    return hp.num_layers, max_num_seqs + 1, min(max_context, hp.context_length), hp.num_kv_heads, hp.head_dim


def kv_cache_bytes(num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, k_type: str = "bf16", v_type: str = "bf16") -> int:
    """Device bytes of a cache of these dimensions and K / V types (dtype: the activation dtype)."""
    rows = num_layers * num_slots * num_kv_heads * max_len
    return rows * sum(row_bytes(kv_qtype(t), head_dim, dtype) for t in (k_type, v_type))


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, k_type: str = "bf16", v_type: str = "bf16") -> None:
        self.k_qtype, self.v_qtype = kv_qtype(k_type), kv_qtype(v_type)
        shape = (num_layers, num_slots, num_kv_heads, max_len)
        self.k = zeros(shape, self.k_qtype, head_dim, dtype, device)
        self.v = zeros(shape, self.v_qtype, head_dim, dtype, device)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def num_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def qtypes(self) -> tuple[QType | None, QType | None]:
        """The block formats of K and V (None: rows in the activation dtype)."""
        return self.k_qtype, self.v_qtype

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: `[tokens, kv_heads, head_dim]` stored at (slot, position) of each token."""
        write_kv(self.k[layer], self.v[layer], slot_ids, positions, k, v, *self.qtypes)

    def window(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every slot (views): `[slots, kv_heads, length, row]`, a row
        `head_dim` values or a quantized row's bytes."""
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

