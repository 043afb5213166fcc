"""Gate/up and down stages for formats without a dedicated kernel, and for the tables' math other than
plain (`ops.expert_math`: biases, another activation): each pair's expert bytes are gathered through the
pointer tables, dequantized with `ops.quants` and multiplied in float32.

Correct for every format `ops.quants` reads; it works on CHUNK_PAIRS pairs at a time to bound the
dequantized memory. No host sync and shapes that depend only on the pair count (the table formats
IQ4_NL, IQ4_XS and MXFP4 upload a small lookup table per call, so those cannot be graph-captured).
"""

from __future__ import annotations

import torch

from ops.quants import dequantize
from ops.triton.gather import launch_gather
from ops.triton.tables import ExpertTables, QType

CHUNK_PAIRS = 16


def _weights(ptrs: torch.Tensor, expert_ids: torch.Tensor, first: int, count: int, tables: ExpertTables,
             qtype: QType, rows: int, cols: int, row_bytes: int) -> torch.Tensor:
    """float32 `[count, rows, cols]`: the projection of pairs first .. first + count - 1 (0 if skipped)."""
    raw = torch.empty((count, rows * row_bytes), dtype=torch.uint8, device=tables.device)
    launch_gather(ptrs, expert_ids, first, tables, raw)
    return dequantize(raw.view(count, rows, row_bytes), qtype, cols)


def gate_up_fallback(x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor, tables: ExpertTables,
                     h: torch.Tensor) -> None:
    """Same contract as `launch_gate_up` (rows of skipped pairs are written too)."""
    num_tokens = x.shape[0]
    for first in range(0, expert_ids.shape[0], CHUNK_PAIRS):
        count = min(CHUNK_PAIRS, expert_ids.shape[0] - first)
        tokens = token_ids[first : first + count]
        in_range = ((tokens >= 0) & (tokens < num_tokens))[:, None]
        xs = torch.where(in_range, x[tokens.clamp(0, max(num_tokens - 1, 0))].float(), 0.0)[..., None]
        gate = _weights(tables.gate_ptrs, expert_ids, first, count, tables, tables.gate_type, tables.ff,
                        tables.hidden, tables.gate_row_bytes)
        up = _weights(tables.up_ptrs, expert_ids, first, count, tables, tables.up_type, tables.ff,
                      tables.hidden, tables.up_row_bytes)
        h[first : first + count] = tables.math.hidden(torch.bmm(gate, xs)[..., 0], torch.bmm(up, xs)[..., 0],
                                                      expert_ids[first : first + count].long())


def is_computed(expert_ids: torch.Tensor, tables: ExpertTables) -> torch.Tensor:
    """bool `[pairs]`: the expert id is in range and all three of its pointers are set (no host sync)."""
    in_range = (expert_ids >= 0) & (expert_ids < tables.num_experts)
    safe = torch.where(in_range, expert_ids, 0).long()
    return in_range & (tables.gate_ptrs[safe] > 0) & (tables.up_ptrs[safe] > 0) & (tables.down_ptrs[safe] > 0)


def down_fallback(h: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, tables: ExpertTables,
                  y: torch.Tensor) -> None:
    """Same contract as `launch_down`: skipped pairs get 0 (whatever their h holds)."""
    computed = is_computed(expert_ids, tables)
    for first in range(0, expert_ids.shape[0], CHUNK_PAIRS):
        count = min(CHUNK_PAIRS, expert_ids.shape[0] - first)
        down = _weights(tables.down_ptrs, expert_ids, first, count, tables, tables.down_type, tables.hidden,
                        tables.ff, tables.down_row_bytes)
        scale = weights[first : first + count].float()[:, None]
        value = scale * tables.math.output(torch.bmm(down, h[first : first + count, :, None])[..., 0],
                                           expert_ids[first : first + count].long())
        y[first : first + count] = torch.where(computed[first : first + count, None], value, 0.0)
