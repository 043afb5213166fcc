"""KV cache types: K and V rows in the activation dtype, or in ggml's 32-value blocks (q8_0, q4_0).

A quantized row of `head_dim` values is `head_dim / 32` blocks as `ops.quants` makes them (bit for bit as gguf),
laid out with the blocks' fp16 scales first, then their codes in block order (`to_planar`): the bytes of ggml's
blocks, rearranged so that a row's codes start 2 * blocks bytes in, for aligned vector loads (ggml's 34- and
18-byte blocks leave them 2-byte aligned). A cache of them is uint8 `[..., row_bytes]`. The write kernel quantizes,
the attention kernels dequantize their tiles as they read them; the functions here are the torch references of
both, which the CPU engine runs.
"""

from __future__ import annotations

import torch

from ops import quants
from ops.quants import QType

# bf16: unquantized, in the activation dtype (bf16 on CUDA); names as llama.cpp's `--cache-type-k/v`
KV_CACHE_TYPES: dict[str, QType | None] = {"bf16": None, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}


def kv_qtype(name: str) -> QType | None:
    """The block format of a KV cache type (None: unquantized); ValueError naming the choices."""
    if name not in KV_CACHE_TYPES:
        raise ValueError(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)} (got {name!r})")
    return KV_CACHE_TYPES[name]


def check_head_dim(qtype: QType | None, head_dim: int) -> None:
    """A quantized row is whole blocks: head_dim a multiple of the block size."""
    if qtype is not None and head_dim % quants.format_of(qtype).block_size:
        raise ValueError(f"a {qtype.name.lower()} KV cache needs head_dim a multiple of "
                         f"{quants.format_of(qtype).block_size}, got {head_dim}")


def row_bytes(qtype: QType | None, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cached K or V row of one head."""
    if qtype is None:
        return head_dim * dtype.itemsize
    check_head_dim(qtype, head_dim)
    return quants.row_bytes(qtype, head_dim)


def zeros(shape: tuple[int, ...], qtype: QType | None, head_dim: int, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache of rows `[*shape, row]`: head_dim values of dtype, or the row's bytes (uint8)."""
    if qtype is None:
        return torch.zeros((*shape, head_dim), dtype=dtype, device=device)
    return torch.zeros((*shape, row_bytes(qtype, head_dim, dtype)), dtype=torch.uint8, device=device)


def quantize_rows(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    """`[..., head_dim]` -> uint8 `[..., row_bytes]`, scales first (`to_planar`)."""
    return to_planar(quants.quantize(x.float(), qtype), qtype)


def to_planar(blocks: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Rows of ggml blocks uint8 `[..., n * type_size]` -> the same rows as their n fp16 scales, then their codes."""
    split = blocks.view(*blocks.shape[:-1], -1, quants.format_of(qtype).type_size)
    return torch.cat([split[..., :2].flatten(-2), split[..., 2:].flatten(-2)], dim=-1)


def from_planar(rows: torch.Tensor, qtype: QType) -> torch.Tensor:
    """`to_planar`'s rows -> rows of ggml blocks."""
    n = rows.shape[-1] // quants.format_of(qtype).type_size
    scales = rows[..., :2 * n].reshape(*rows.shape[:-1], n, 2)
    return torch.cat([scales, rows[..., 2 * n:].reshape(*rows.shape[:-1], n, -1)], dim=-1).flatten(-2)


def dense(cache: torch.Tensor, qtype: QType | None, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as values `[..., head_dim]` of `dtype`: dequantized (in float32, then rounded to dtype,
    as the kernels do) or the rows themselves."""
    if qtype is None:
        return cache
    return quants.dequantize(from_planar(cache, qtype), qtype, head_dim).to(dtype)


def latent_value_dim(head_dim: int, v_cache: torch.Tensor, k_qtype: QType | None, v_qtype: QType | None) -> int:
    """The values' width: a latent cache's (unquantized, narrower than the keys), else head_dim."""
    if k_qtype is None and v_qtype is None and v_cache.dim() == 4 and v_cache.shape[3] < head_dim:
        return int(v_cache.shape[3])
    return head_dim
