"""A bank of routed experts as raw GGUF bytes, and the size of one expert.

A bank's first dimension indexes experts (or cache slots): a layer in host memory, a layer resident on
the device, a pool of cache slots, or a layer staged for a prefill. Every expert-FFN path
(`ops.expert_ffn`) reads one; `expert_bytes` is the one count of an expert's bytes that the kernels'
tables, the cache's plans and the benchmarks share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from ops.expert_math import PLAIN, ExpertMath
from ops.quants import QType


def row_bytes(qtype: QType, num_cols: int) -> int:
    """Bytes of a row of `num_cols` weights, for any type ggml knows: a bank may hold a type no path computes
    (`moecache plan` sizes such a model; `ops.quants.row_bytes` knows the types it can dequantize)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if num_cols % block_size:
        raise ValueError(f"{qtype.name}: row of {num_cols} is not a multiple of {block_size}")
    return num_cols // block_size * type_size


def expert_bytes(gate_type: QType, up_type: QType, down_type: QType, hidden: int, ff: int) -> int:
    """Bytes of one expert: gate and up (`ff` rows of `hidden` weights each) and down (`hidden` rows of `ff`)."""
    return ff * (row_bytes(gate_type, hidden) + row_bytes(up_type, hidden)) + hidden * row_bytes(down_type, ff)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged gate/up experts `[experts, 2 * ff, row bytes]` (GGUF's `ffn_gate_up_exps`: gate rows first) ->
    gate and up views `[experts, ff, row bytes]`, nothing copied."""
    ff = gate_up.shape[1] // 2
    return gate_up[:, :ff], gate_up[:, ff:]


@dataclass(frozen=True)
class ExpertWeights:
    """A bank of routed experts as raw GGUF bytes (uint8), first dimension = expert or slot. Each expert's
    matrix is contiguous; experts may lie further apart (gate and up as views of merged gate/up experts)."""

    gate: torch.Tensor  # [num_experts, ff, row_bytes(gate_type, hidden)]
    up: torch.Tensor  # [num_experts, ff, row_bytes(up_type, hidden)]
    down: torch.Tensor  # [num_experts, hidden, row_bytes(down_type, ff)]
    gate_type: QType
    up_type: QType
    down_type: QType
    hidden: int
    ff: int
    math: ExpertMath = PLAIN  # biases (indexed by the bank's rows) and activation: ops/expert_math.py
    planar: bool = False  # its MXFP4 matrices in `to_planar`'s order (a device-resident bank), not GGUF's

    def __post_init__(self) -> None:
        for name in ("gate_type", "up_type", "down_type"):
            object.__setattr__(self, name, QType(getattr(self, name)))
        num_experts = self.gate.shape[0]
        self._check("gate", self.gate, (num_experts, self.ff, row_bytes(self.gate_type, self.hidden)))
        self._check("up", self.up, (num_experts, self.ff, row_bytes(self.up_type, self.hidden)))
        self._check("down", self.down, (num_experts, self.hidden, row_bytes(self.down_type, self.ff)))

    @staticmethod
    def _check(name: str, t: torch.Tensor, shape: tuple[int, int, int]) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.dtype != torch.uint8 or not t[0].is_contiguous() or (t.shape[0] > 1 and t.stride(0) < t[0].numel()):
            raise ValueError(f"{name}: expected uint8 bytes, each expert contiguous, got {t.dtype} on {t.device}")

    @property
    def is_contiguous(self) -> bool:
        """Every matrix one contiguous block (what the native CPU kernel reads)."""
        return all(t.is_contiguous() for t in (self.gate, self.up, self.down))

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down)."""
        return expert_bytes(self.gate_type, self.up_type, self.down_type, self.hidden, self.ff)


# --- planar MXFP4: GGUF's 17-byte blocks (an e8m0 scale, 16 code bytes) put 16 code bytes at odd offsets, which a
# GPU reads a byte at a time. A planar matrix holds each group of PLANAR_ROWS rows as the group's code bytes, row
# after row (a row's codes 16-byte aligned: rows of 32-blocks have K / 2 code bytes), then the group's scale bytes,
# row after row: the same bytes per matrix, so a planar bank has GGUF's shapes and sizes.
PLANAR_ROWS = 16


def to_planar(bank: ExpertWeights) -> ExpertWeights:
    """The bank with its MXFP4 matrices planar (a new bank on the same device; the others shared), or the bank."""
    if bank.planar or QType.MXFP4 not in (bank.gate_type, bank.up_type, bank.down_type):
        return bank
    gate, up, down = (_planar(t, qtype, cols, True) for t, qtype, cols in _matrices(bank))
    return replace(bank, gate=gate, up=up, down=down, planar=True)


def gguf_experts(bank: ExpertWeights, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate, up and down bytes of the bank's `rows` in GGUF's blocks (a planar bank's converted back)."""
    return tuple(_planar(t[rows], qtype, cols, False) if bank.planar else t[rows]  # type: ignore[return-value]
                 for t, qtype, cols in _matrices(bank))


def _matrices(bank: ExpertWeights) -> tuple[tuple[torch.Tensor, QType, int], ...]:
    return ((bank.gate, bank.gate_type, bank.hidden), (bank.up, bank.up_type, bank.hidden),
            (bank.down, bank.down_type, bank.ff))


def _planar(t: torch.Tensor, qtype: QType, cols: int, forward: bool) -> torch.Tensor:
    """Matrices `[n, rows, row bytes]` of `qtype` to planar (forward) or back; other types as they are."""
    if qtype != QType.MXFP4:
        return t
    n, rows, blocks = t.shape[0], t.shape[1], cols // 32
    if rows % PLANAR_ROWS:
        raise ValueError(f"planar MXFP4 needs rows in groups of {PLANAR_ROWS}, got {rows}")
    groups = rows // PLANAR_ROWS
    if forward:
        gguf = t.reshape(n, groups, PLANAR_ROWS, blocks, 17)
        parts = (gguf[..., 1:].reshape(n, groups, -1), gguf[..., 0].reshape(n, groups, -1))
        return torch.cat(parts, dim=2).reshape(t.shape)
    flat = t.reshape(n, groups, -1)
    codes = flat[..., :PLANAR_ROWS * blocks * 16].reshape(n, groups, PLANAR_ROWS, blocks, 16)
    scales = flat[..., PLANAR_ROWS * blocks * 16:].reshape(n, groups, PLANAR_ROWS, blocks, 1)
    return torch.cat((scales, codes), dim=4).reshape(t.shape)


# byte offsets of the fp16 scale fields (d, dmin) in one block of each format
SCALE_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}
# byte offsets of the e8m0 exponent fields (w = 2**(e - 128) * code) in one block of each format
E8M0_FIELDS: dict[QType, tuple[int, ...]] = {QType.MXFP4: (0,)}
_FLOAT_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


def random_rows(rng: np.random.Generator, num_rows: tuple[int, int], num_cols: int, qtype: QType) -> torch.Tensor:
    """Valid random bytes uint8 [*num_rows, row_bytes]: random blocks with small finite scales."""
    if qtype in _FLOAT_DTYPES:
        values = torch.from_numpy(rng.standard_normal((*num_rows, num_cols), dtype=np.float32) * 0.05)
        return values.to(_FLOAT_DTYPES[qtype]).view(torch.uint8).contiguous()
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*num_rows, num_cols // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_FIELDS.get(qtype, ()):
        scales = rng.uniform(1e-4, 1e-3, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    for offset in E8M0_FIELDS.get(qtype, ()):
        blocks[..., offset] = rng.integers(119, 123, blocks.shape[:-1])  # 2**-9 .. 2**-6 times codes <= 12
    return torch.from_numpy(blocks.reshape(*num_rows, -1))


def random_expert_weights(
    num_experts: int,
    hidden: int,
    ff: int,
    gate_type: QType,
    up_type: QType | None = None,
    down_type: QType | None = None,
    seed: int = 0,
) -> ExpertWeights:
    """A bank of valid random experts (tests and benchmarks); the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    up_type, down_type = up_type or gate_type, down_type or gate_type
    return ExpertWeights(
        gate=random_rows(rng, (num_experts, ff), hidden, gate_type),
        up=random_rows(rng, (num_experts, ff), hidden, up_type),
        down=random_rows(rng, (num_experts, hidden), ff, down_type),
        gate_type=gate_type,
        up_type=up_type,
        down_type=down_type,
        hidden=hidden,
        ff=ff,
    )
