"""Dense matrices kept quantized on the device: `Q8Weight`, a GGUF Q8_0 matrix repacked for aligned loads.

A GGUF Q8_0 row is blocks of 34 bytes (fp16 d, 32 int8 codes): 2-byte aligned, no wider load. `from_gguf` repacks
it once at load into the codes `[N, K]` (rows of whole 16-byte words) and the scales `[N, K / 32]`: the same 34
bytes per 32 weights, half the bytes of the bf16 copy the matrix otherwise becomes. Every decode step reads the
dense matrices whole (Qwen3-30B-A3B's attention and output: 2.4 GB a token in bf16, 1.3 GB as Q8_0).
`ops.fused.linear` multiplies by it (`ops.triton.qlinear` on CUDA, the dequantized matrix elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per scale
BLOCK_BYTES = 34


@dataclass(frozen=True)
class Q8Weight:
    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float16 [N, K // 32]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int], device: torch.device) -> Q8Weight:
        """GGUF Q8_0 bytes of a matrix `shape` (uint8, any device) -> its codes and scales on `device`."""
        rows, cols = shape
        expected = rows * (cols // BLOCK) * BLOCK_BYTES
        if cols % BLOCK or raw.numel() != expected:
            raise ValueError(f"Q8_0 {shape}: expected {expected} bytes in blocks of {BLOCK}, got {raw.numel()}")
        blocks = raw.to(device).reshape(rows, cols // BLOCK, BLOCK_BYTES)
        scales = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, cols // BLOCK)
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return cls(codes, scales)

    @classmethod
    def stack(cls, parts: list[Q8Weight]) -> Q8Weight:
        """The parts' rows one after the other (q, k and v as one matrix)."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[N, K]`: d * q, computed in float32 and rounded once to `dtype`."""
        n, k = self.codes.shape
        values = self.codes.float().view(n, k // BLOCK, BLOCK) * self.scales.float()[..., None]
        return values.view(n, k).to(dtype)


Matrix = torch.Tensor | Q8Weight  # a dense matrix as a model holds it
