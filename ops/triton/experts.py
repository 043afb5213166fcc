"""Grouped expert FFN on the GPU from raw GGUF bytes: the entry points of `ops.triton`.

One call computes `out[t] = sum_p w_p * down_e(act(gate_e(x_t), up_e(x_t)))` over the pairs
p = (t, e) of a step in four launches: prepare x (its columns in the kernel's order, sums per 16
columns), gate/up -> h `[pairs, ff]`, down -> y `[pairs, hidden]`, and a per-token sum of y in pair
order. That last sum is deterministic (the same inputs give the same bits, which atomics would not)
and costs pairs x hidden x 8 bytes, under 1% of the expert bytes. Pairs of one expert are computed
together, so its weights are read once per step and group of up to `block_tokens` pairs. No host
sync and a grid that depends only on (pairs, shapes): a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.bank import ExpertWeights
from ops.cache_step import Bell
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_rows, check_vector, resolve
from ops.triton.combine import launch_combine
from ops.triton.down import launch_down
from ops.triton.fallback import down_fallback, gate_up_fallback
from ops.triton.gate_up import default_block_tokens, launch_gate_up
from ops.triton.prepare import Prepared, launch_prepare
from ops.triton.qdot import GROUP, has_kernel, reads_int8
from ops.triton.stage import Fill, fill_experts
from ops.triton.tables import ExpertTables, QType

_TABLE_CACHE_SIZE = 256
_table_cache: dict[tuple[torch.device, int, int, int], torch.Tensor] = {}


@dataclass(frozen=True)
class LaunchConfig:
    """Block shapes: rows of ff (gate/up) and of hidden (down) per program, pairs of one expert per
    pass over its weights (None: by the number of tokens), blocks of 32 a step of the 32-block formats (0: by the
    row, `qdot.step_blocks`); whether an expert's passes run in programs side by side (`spread`, `pairs`) or in its
    first pair's program one after another."""

    gate_up_rows: int = 16
    down_rows: int = 32
    block_tokens: int | None = None
    blocks: int = 0
    spread: bool = True


DEFAULT_CONFIG = LaunchConfig()


def grouped_expert_ffn(x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                       tables: ExpertTables, out: torch.Tensor | None = None,
                       config: LaunchConfig = DEFAULT_CONFIG, fill: Fill | None = None,
                       extra: torch.Tensor | None = None, extra_bell: Bell | None = None,
                       prepared: Prepared | None = None) -> torch.Tensor:
    """x `[tokens, hidden]` (bf16/fp16/fp32); token_ids, expert_ids (int32/int64), weights `[pairs]`
    -> float32 `[tokens, hidden]`, or written into `out` if given (float32 or 16-bit). Pairs with expert
    id -1 (or out of range, or a pointer <= 0) are skipped. Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and MXFP4 run dedicated
    kernels; other formats a gather + dequantize path. `fill`: experts first copied from host memory to
    the tables' addresses (inside the kernels that read them); `extra`: float32 `[tokens, hidden]` added (the
    CPU's share of the pairs), with `extra_bell` once the CPU answered (`ops.triton.bell`). `prepared`: x already
    prepared for the gate format (`gate_format`, e.g. by `ops.triton.cache_step.assign_experts`), read instead of a
    launch of its own. The tables' math (`ops.expert_math.ExpertMath`: the activation, biases) runs inside the
    kernels."""
    num_pairs, num_tokens, device = expert_ids.shape[0], x.shape[0], tables.device
    check_rows("x", x, (num_tokens, tables.hidden), FLOAT_DTYPES, device)
    check_vector("token_ids", token_ids, num_pairs, INDEX_DTYPES, device)
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    check_vector("weights", weights, num_pairs, FLOAT_DTYPES, device)
    if out is None:
        out = torch.empty((num_tokens, tables.hidden), dtype=torch.float32, device=device)
    check_rows("out", out, (num_tokens, tables.hidden), FLOAT_DTYPES, device)
    if num_tokens == 0:
        return out
    block_tokens = config.block_tokens or default_block_tokens(num_tokens, tables.gate_type)
    down_tokens = config.block_tokens or default_block_tokens(num_tokens, tables.down_type)
    fused = all(has_kernel(t) for t in (tables.gate_type, tables.up_type, tables.down_type))
    if fill is not None and not fused:  # the fallback reads whole experts: copy them first
        fill_experts(expert_ids, tables, fill)
        fill = None
    y = _ffn(x, token_ids, expert_ids, weights, tables, config, (block_tokens, down_tokens), fill, prepared)
    launch_combine(y, token_ids, out, extra=extra, bell=extra_bell)
    return out


def _ffn(x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
         tables: ExpertTables, config: LaunchConfig, block_tokens: tuple[int, int], fill: Fill | None,
         prepared: Prepared | None) -> torch.Tensor:
    """y `[pairs, hidden]`: each pair's weighted down(act(gate x, up x)) (the tables' math), 0 for skipped pairs.
    block_tokens: gate/up's and down's pairs a pass."""
    h, h_sums, y = _gate_up(x, token_ids, expert_ids, tables, config, block_tokens[0], fill, prepared)
    if has_kernel(tables.down_type):
        launch_down(h, h_sums, expert_ids, weights, tables, y, block_tokens=block_tokens[1],
                    block_rows=config.down_rows, fill=fill, blocks=config.blocks, spread=config.spread)
    else:
        down_fallback(h, expert_ids, weights, tables, y)
    return y


def _gate_up(x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor, tables: ExpertTables,
             config: LaunchConfig, block_tokens: int, fill: Fill | None = None,
             prepared: Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (prepared for the down projection), its sums per 16 columns, and the empty y."""
    num_pairs, device = expert_ids.shape[0], tables.device
    h = torch.empty((num_pairs, tables.ff), dtype=torch.float32, device=device)
    h_sums = torch.empty((num_pairs, tables.ff // GROUP), dtype=torch.float32, device=device)
    y = torch.empty((num_pairs, tables.hidden), dtype=torch.float32, device=device)
    if has_kernel(tables.gate_type) and has_kernel(tables.up_type):
        if prepared is not None and (prepared.qtype != tables.gate_type or prepared.x.shape != x.shape):
            raise ValueError(f"x {tuple(x.shape)} prepared as {tuple(prepared.x.shape)} for {prepared.qtype}, "
                             f"the gate is {tables.gate_type.name}")
        x_gate, x_sums = (prepared.x, prepared.sums) if prepared is not None else launch_prepare(x, tables.gate_type)
        x_up = x_gate if tables.up_type == tables.gate_type else launch_prepare(x, tables.up_type)[0]
        launch_gate_up(x_gate, x_up, x_sums, token_ids, expert_ids, tables, h, h_sums,
                       block_tokens=block_tokens, block_rows=config.gate_up_rows, fill=fill, blocks=config.blocks,
                       spread=config.spread)
        if reads_int8(tables.down_type):  # h came out in natural order: its planes are quantized per row
            h, h_sums = launch_prepare(h, tables.down_type)
    else:
        gate_up_fallback(x, token_ids, expert_ids, tables, h)
        if has_kernel(tables.down_type):
            h, h_sums = launch_prepare(h, tables.down_type)
    return h, h_sums, y


def gate_format(tables: ExpertTables) -> QType | None:
    """The format x is prepared for when the tables run the dedicated kernels (`grouped_expert_ffn`'s
    `prepared`), else None."""
    kernels = all(has_kernel(t) for t in (tables.gate_type, tables.up_type, tables.down_type))
    return tables.gate_type if kernels else None


def tables_from_bank(bank: ExpertWeights, device: torch.device) -> ExpertTables:
    """Pointer tables on `device` addressing every row of the bank. The bank lives on `device`, or in
    pinned host memory (read zero-copy by the GPU)."""
    device = resolve(device)
    shapes = {"gate": (bank.ff, bank.gate_type, bank.hidden), "up": (bank.ff, bank.up_type, bank.hidden),
              "down": (bank.hidden, bank.down_type, bank.ff)}
    ptrs: dict[str, torch.Tensor] = {}
    for name, (rows, qtype, cols) in shapes.items():
        t = getattr(bank, name)
        expected = (rows, ExpertTables.row_bytes_of(qtype, cols))
        if t.dtype != torch.uint8 or t.dim() != 3 or tuple(t.shape[1:]) != expected:
            raise ValueError(f"{name}: expected uint8 [n, {expected[0]}, {expected[1]}], got {t.dtype} "
                             f"{tuple(t.shape)}")
        ptrs[name] = _row_pointers(name, t, device)
    return ExpertTables(ptrs["gate"], ptrs["up"], ptrs["down"], bank.gate_type, bank.up_type, bank.down_type,
                        bank.hidden, bank.ff, bank.math.to(device), bank.planar)


def expert_ffn_triton(x: torch.Tensor, token_ids: torch.Tensor, bank_rows: torch.Tensor, weights: torch.Tensor,
                      bank: ExpertWeights) -> torch.Tensor:
    """The signature of `ops.expert_ffn`: pairs (token, bank row), row -1 skipped."""
    return grouped_expert_ffn(x, token_ids, bank_rows, weights, tables_from_bank(bank, x.device))


def _row_pointers(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 `[rows]`: the address of each bank row, cached (a table depends only on these numbers)."""
    is_reachable = t.device == device or (t.device.type == "cpu" and device.type == "cuda" and t.is_pinned())
    if not is_reachable:
        raise ValueError(f"{name}: a bank on {t.device} cannot be read from {device} (pin host banks)")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name}: each bank row must be contiguous, got strides {t.stride()}")
    if t.data_ptr() % 16 or t.stride(0) % 16:
        raise ValueError(f"{name}: bank rows must be 16-byte aligned (address {t.data_ptr()}, stride {t.stride(0)})")
    key = (device, t.data_ptr(), t.stride(0), t.shape[0])
    if key in _table_cache:
        return _table_cache[key]
    ptrs = torch.arange(t.shape[0], dtype=torch.int64, device=device) * t.stride(0) + t.data_ptr()
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # a captured table is unwritten
        if len(_table_cache) >= _TABLE_CACHE_SIZE:
            _table_cache.pop(next(iter(_table_cache)))
        _table_cache[key] = ptrs
    return ptrs
