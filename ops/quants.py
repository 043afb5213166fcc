"""GGUF block formats as data, with torch reference dequantization.

Each format is one small class registered by its ggml type: `block_size` weights are stored in
`type_size` bytes. `dequantize_blocks` maps uint8 `[n, type_size]` to float32 `[n, block_size]` and is
bit-exact against `gguf.quants.dequantize`. Quantizers exist where tests need to write models.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType


class QuantFormat:
    qtype: QType
    block_size: int
    type_size: int
    _registry: dict[QType, type[QuantFormat]] = {}

    def __init_subclass__(cls, qtype: QType) -> None:
        cls.qtype = qtype
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        QuantFormat._registry[qtype] = cls

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{cls.qtype.name} has no dequantizer")

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{cls.qtype.name} has no quantizer")


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 stored in uint8 `[..., 2*n]` -> float32 `[..., n]`."""
    return raw.contiguous().view(torch.float16).float()


class F32(QuantFormat, qtype=QType.F32):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float32).clone()

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.float().contiguous().view(torch.uint8)


class F16(QuantFormat, qtype=QType.F16):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return _f16(blocks)

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.half().contiguous().view(torch.uint8)


class BF16(QuantFormat, qtype=QType.BF16):
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.bfloat16).float()

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.bfloat16().contiguous().view(torch.uint8)


class Q8_0(QuantFormat, qtype=QType.Q8_0):
    # block: fp16 d, int8 qs[32]; w = d * q
    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d = _f16(blocks[:, :2])
        qs = blocks[:, 2:].contiguous().view(torch.int8).float()
        return d * qs


def format_of(qtype: QType | int) -> type[QuantFormat]:
    try:
        return QuantFormat._registry[QType(qtype)]
    except (KeyError, ValueError):
        raise ValueError(f"unsupported tensor type {qtype!r}") from None


def supported_types() -> list[QType]:
    return list(QuantFormat._registry)


def row_bytes(qtype: QType | int, num_cols: int) -> int:
    fmt = format_of(qtype)
    if num_cols % fmt.block_size:
        raise ValueError(f"{fmt.qtype.name}: row of {num_cols} is not a multiple of {fmt.block_size}")
    return num_cols // fmt.block_size * fmt.type_size


def as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A uint8 torch view of raw tensor bytes (no copy for numpy memmaps)."""
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    return raw if raw.dtype == torch.uint8 else raw.contiguous().view(torch.uint8)


def dequantize(raw: torch.Tensor | np.ndarray, qtype: QType | int, num_cols: int) -> torch.Tensor:
    """Raw bytes `[..., row_bytes]` -> float32 `[..., num_cols]`."""
    fmt = format_of(qtype)
    data = as_bytes(raw)
    lead = data.shape[:-1]
    blocks = data.reshape(-1, fmt.type_size)
    out = fmt.dequantize_blocks(blocks)
    return out.reshape(*lead, num_cols)


def quantize(x: torch.Tensor, qtype: QType | int) -> torch.Tensor:
    """float32 `[..., n]` -> raw bytes `[..., row_bytes]`."""
    fmt = format_of(qtype)
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(-1, fmt.block_size)
    out = fmt.quantize_blocks(blocks)
    return out.reshape(*lead, row_bytes(qtype, n))
