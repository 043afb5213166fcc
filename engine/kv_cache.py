"""A contiguous KV cache: one slot of `max_len` positions per running sequence.

Each layer's keys and values are `[slots, kv_heads, max_len, row]`. Layers of one shape are views of one
tensor; where layers differ (Gemma 4: wider heads and fewer KV heads in its full-attention layers, nothing
cached by its shared-KV layers) each layer has a tensor of its own.

K and V rows are kept in the activation dtype (`bf16`: a row is `head_dim` values) or in ggml's q8_0 / q4_0
blocks (`ops.kv_quant`: a row is its blocks' bytes), chosen separately for K and V: the write quantizes,
the attention kernels dequantize as they read. A latent cache (multi-head latent attention, where keys and
values are one tensor) is kept unquantized."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.arch.base import HParams
from ops.fused import KVWrite, write_kv
from ops.kv_quant import kv_qtype, zeros
from ops.quants import QType

LayerShape = tuple[int, int]  # (kv_heads, head_dim) of one layer's cache; 0 heads: the layer caches nothing

KV_TYPE_FLAGS = "--kv-cache-dtype, -ctk/--cache-type-k, -ctv/--cache-type-v"
GIB = 1 << 30


class KVCache:
    def __init__(self, shapes: list[LayerShape], num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, latent_values: int = 0, k_type: str = "bf16", v_type: str = "bf16",
                 stages: Sequence[tuple[range, torch.device]] | None = None) -> None:
        """latent_values > 0: keys and values share one tensor (multi-head latent attention caches each token's
        latent once): the values are the keys' first `latent_values` columns. k_type, v_type: the K and V
        rows' types (`ops.kv_quant.KV_CACHE_TYPES`). stages: the layers' devices where they are several (each range's
        layers cached on its device)."""
        self.k_qtype, self.v_qtype = kv_qtype(k_type), kv_qtype(v_type)
        if latent_values and (self.k_qtype is not None or self.v_qtype is not None):
            raise ValueError(f"a latent KV cache (keys and values in one tensor) is kept in bf16: "
                             f"got K {k_type}, V {v_type} ({KV_TYPE_FLAGS})")
        self.num_slots, self.max_len, self.is_latent = num_slots, max_len, latent_values > 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.storage: list[torch.Tensor] = []
        for layers, on in stages or [(range(len(shapes)), device)]:
            self._allocate([shapes[i] for i in layers], dtype, on, latent_values)

    def _allocate(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device, latent_values: int) -> None:
        """The caches of consecutive layers on one device, appended."""
        def new(heads: int, dim: int, n: int, qtype: QType | None) -> torch.Tensor:
            return zeros((n, self.num_slots, heads, self.max_len), qtype, dim, dtype, device)

        if len(set(shapes)) == 1:  # one tensor for all layers
            k = new(*shapes[0], len(shapes), self.k_qtype)
            v = k[..., :latent_values] if latent_values else new(*shapes[0], len(shapes), self.v_qtype)
            self.storage += [k] if latent_values else [k, v]
            self.k += k.unbind(0)
            self.v += v.unbind(0)
        else:
            keys = [new(heads, dim, 1, self.k_qtype)[0] for heads, dim in shapes]
            values = [new(heads, dim, 1, self.v_qtype)[0] for heads, dim in shapes]
            self.k, self.v, self.storage = self.k + keys, self.v + values, self.storage + keys + values

    @classmethod
    def for_model(cls, hp: HParams, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                  k_type: str = "bf16", v_type: str = "bf16",
                  stages: Sequence[tuple[range, torch.device]] | None = None) -> KVCache:
        """The cache of a model's layout; a quantized K or V type where the layout keeps its cache
        unquantized (MLA's latent cache) is a ValueError naming the layout and the flags."""
        check_kv_types(hp, k_type, v_type)
        if hp.mla is not None:  # [latent, rotary key] per token and layer
            return cls([(1, hp.mla.latent_dim)] * hp.num_layers, num_slots, max_len, dtype, device,
                       hp.mla.kv_lora_rank, stages=stages)
        shapes = [(hp.kv_heads_of(i) if hp.kv_layer(i) == i else 0, hp.head_dim_of(i)) for i in range(hp.num_layers)]
        return cls(shapes, num_slots, max_len, dtype, device, 0, k_type, v_type, stages)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage)

    def layer_bytes(self, layer: int) -> int:
        """Bytes of one layer's keys and values (a latent cache's one tensor once)."""
        k, v = self.k[layer], self.v[layer]
        return k.numel() * k.element_size() + (0 if self.is_latent else v.numel() * v.element_size())

    @property
    def qtypes(self) -> tuple[QType | None, QType | None]:
        """The block formats of K and V (None: rows in the activation dtype)."""
        return self.k_qtype, self.v_qtype

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: `[tokens, kv_heads, head_dim]` stored at (slot, position) of each token. A latent cache's entries are
        stored by the launch that computes them (`ops.fused.mla_qk`)."""
        if self.is_latent:
            raise ValueError("a latent cache is written by ops.fused.mla_qk")
        write_kv(self.k[layer], self.v[layer], slot_ids, positions, k, v, *self.qtypes)

    def plain_write(self, layer: int, slot_ids: torch.Tensor, v: torch.Tensor) -> KVWrite | None:
        """The layer's caches for the launch that rotates the keys to store into (`ops.fused.qk_norm_rope`), with
        the values `[tokens, kv_heads, head_dim]`: where K and V are unquantized and separate; else None (`write`)."""
        if self.is_latent or self.k_qtype is not None or self.v_qtype is not None:
            return None
        return KVWrite(self.k[layer], self.v[layer], slot_ids, v)

    def window(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every slot (views): `[slots, kv_heads, length, row]`, a row
        `head_dim` values or a quantized row's bytes."""
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]


def check_kv_types(hp: HParams, k_type: str, v_type: str) -> None:
    """ValueError for a K / V type the model's cache layout does not take: MLA's latent cache (keys and values
    in one tensor) is kept in bf16; the layouts with separate K and V take every type."""
    if hp.mla is not None and (kv_qtype(k_type) is not None or kv_qtype(v_type) is not None):
        raise ValueError(f"{hp.arch} caches an MLA latent (multi-head latent attention: keys and values in one "
                         f"tensor), kept in bf16; quantized KV cache types are for models with separate K and V: "
                         f"got K {k_type}, V {v_type} ({KV_TYPE_FLAGS})")


def kv_cache_bytes(hp: HParams, num_slots: int, max_len: int, dtype: torch.dtype, k_type: str = "bf16",
                   v_type: str = "bf16", layers: Iterable[int] | None = None) -> int:
    """Device bytes of a model's cache of these slots, positions and K / V types (dtype: the activation
    dtype), counted on the meta device: nothing is allocated. Refuses what `KVCache.for_model` refuses.
    layers: only theirs (one device's share of a split model)."""
    cache = KVCache.for_model(hp, num_slots, max_len, dtype, torch.device("meta"), k_type, v_type)
    return cache.num_bytes if layers is None else sum(cache.layer_bytes(i) for i in layers)


def check_kv_fits(hp: HParams, max_num_seqs: int, max_len: int, dtype: torch.dtype, kv_types: tuple[str, str],
                  free_bytes: int | None, layers: range | None = None, device: str = "the device") -> None:
    """A KV cache larger than the device's free memory (None: the host's, not checked) is a ValueError naming its
    size and the options that set it, before the allocation fails. layers: the device's (a split model)."""
    size = kv_cache_bytes(hp, max_num_seqs + 1, max_len, dtype, *kv_types, layers=layers)
    if free_bytes is not None and size > free_bytes:
        raise ValueError(
            f"the KV cache needs {size / GIB:.1f} GiB ({max_num_seqs} sequences of {max_len} positions and a scratch "
            f"slot; K {kv_types[0]}, V {kv_types[1]}) and {device} has {free_bytes / GIB:.1f} GiB free after the "
            f"weights: lower --max-num-seqs or -c/--ctx-size, or quantize it ({KV_TYPE_FLAGS} q8_0 or q4_0)")
