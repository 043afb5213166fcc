"""How the device computes the pairs it is given: cache hits from slots, and (stream mode) misses read
from host memory. Two strategies with one interface:

- `TableCompute` (CUDA with Triton): per-layer pointer tables hold, for every expert, the address of
  its bytes: a VRAM slot when cached, pinned host memory otherwise (read zero-copy over PCIe). Hits
  and streamed misses are one grouped launch, with no host sync: a decode step can be a CUDA graph.
- `BankCompute` (any device): hits from the slot pool; device-read misses staged from host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.expert_cache.device import empty_bank, expert_parts
from ops.cpu_experts import ExpertWeights
from ops.expert_ffn import expert_ffn

if TYPE_CHECKING:
    from ops.triton import ExpertTables


class BankCompute:
    def __init__(self, host: Mapping[int, ExpertWeights], resident: Mapping[int, ExpertWeights],
                 pools: Mapping[int, ExpertWeights], group_of: Mapping[int, int], device: torch.device) -> None:
        self.host, self.resident, self.pools, self.group_of, self.device = host, resident, pools, group_of, device

    def resident_ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        return expert_ffn(x, tokens, experts, weights, self.resident[layer])

    def ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor | None:
        """Pairs with expert id >= 0: from their slot when cached, else staged from host memory."""
        pool = self.pools.get(self.group_of[layer])
        out = None
        if pool is not None:
            out = expert_ffn(x, tokens, torch.where(experts >= 0, slots, -1), weights, pool)
        missed = experts[(experts >= 0) & (slots < 0)].unique().cpu()
        if missed.numel():
            staged = self._staged(layer, x, tokens, experts, weights, missed)
            out = staged if out is None else out + staged
        return out

    def _staged(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        host = self.host[layer]
        row_of = torch.full((host.gate.shape[0],), -1, dtype=torch.int64)
        if self.device.type == "cpu":  # host memory is the device's memory: read in place
            bank, row_of[chosen] = host, chosen
        else:
            bank, row_of[chosen] = empty_bank(host, len(chosen), self.device), torch.arange(len(chosen))
            for row, expert in enumerate(chosen.tolist()):
                for dst, src in zip(expert_parts(bank, row), expert_parts(host, expert)):
                    dst.copy_(src, non_blocking=True)
        rows = row_of.to(self.device)[experts.clamp(min=0)]  # NOTE: -1 (not the device's pair) must not wrap
        return expert_ffn(x, tokens, torch.where(experts >= 0, rows, -1), weights, bank)

    def update(self, entries: list[tuple[int, int, int]]) -> None:
        """Slots are looked up in the slot table; nothing else to change."""


class TableCompute:
    def __init__(self, host: Mapping[int, ExpertWeights], resident: Mapping[int, ExpertWeights],
                 pools: Mapping[int, ExpertWeights], group_of: Mapping[int, int], device: torch.device) -> None:
        from ops.triton import grouped_expert_ffn, tables_from_bank  # Triton is optional (CUDA only)

        self.grouped_ffn = grouped_expert_ffn
        self.host, self.pools, self.group_of = host, pools, group_of
        self.resident = {layer: tables_from_bank(bank, device) for layer, bank in resident.items()}
        # NOTE: a host layer's table starts all-host; `update` points cached experts at their slots.
        self.tables = {layer: _copy_tables(tables_from_bank(bank, device)) for layer, bank in host.items()}

    def resident_ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        return self.grouped_ffn(x, tokens, experts, weights, self.resident[layer])

    def ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """Pairs with expert id >= 0, through the layer's table (slots and host memory alike)."""
        return self.grouped_ffn(x, tokens, experts, weights, self.tables[layer])

    def update(self, entries: list[tuple[int, int, int]]) -> None:
        """(layer, expert, slot or -1): point each expert at its slot, or back at host memory."""
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for layer, expert, slot in entries:
            by_layer.setdefault(layer, []).append((expert, slot))
        for layer, changes in by_layer.items():
            self._update_layer(layer, changes)

    def _update_layer(self, layer: int, changes: list[tuple[int, int]]) -> None:
        host, pool, tables = self.host[layer], self.pools.get(self.group_of[layer]), self.tables[layer]
        experts = torch.tensor([e for e, _ in changes], dtype=torch.int64)
        for part, ptrs in (("gate", tables.gate_ptrs), ("up", tables.up_ptrs), ("down", tables.down_ptrs)):
            values = [_row_address(getattr(pool, part), slot) if slot >= 0 else
                      _row_address(getattr(host, part), expert) for expert, slot in changes]
            ptrs[experts.to(ptrs.device)] = torch.tensor(values, dtype=torch.int64).to(ptrs.device)


def _row_address(bank_part: torch.Tensor, row: int) -> int:
    return bank_part.data_ptr() + row * bank_part.stride(0)


def _copy_tables(tables: ExpertTables) -> ExpertTables:
    """Own pointer tensors (tables_from_bank may share cached ones between banks)."""
    return replace(tables, gate_ptrs=tables.gate_ptrs.clone(), up_ptrs=tables.up_ptrs.clone(),
                   down_ptrs=tables.down_ptrs.clone())


def make_compute(host: Mapping[int, ExpertWeights], resident: Mapping[int, ExpertWeights],
                 pools: Mapping[int, ExpertWeights], group_of: Mapping[int, int],
                 device: torch.device) -> BankCompute | TableCompute:
    """Pointer tables on CUDA when Triton is available; banks otherwise."""
    if device.type == "cuda" and triton_available():
        return TableCompute(host, resident, pools, group_of, device)
    return BankCompute(host, resident, pools, group_of, device)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
