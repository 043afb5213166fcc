"""How the device computes the pairs it is given: cache hits from slots, and (stream mode) misses read
from host memory. Two strategies with one interface:

- `TableCompute` (CUDA with Triton): per-layer pointer tables hold, for every expert, the address of
  its bytes: a VRAM slot when cached, pinned host memory otherwise. Streamed misses are first copied
  by the device into a VRAM staging row (`ops.triton.stage`: a copy kernel reads host memory at the
  link's speed, the grouped FFN reading it in place at half of that), then hits and misses are one
  grouped launch from VRAM. No host sync: a decode step can be a CUDA graph.
- `BankCompute` (any device): hits from the slot pool; device-read misses staged from host memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.expert_cache.device import bank_shape, empty_bank, expert_parts
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
            weights: torch.Tensor) -> torch.Tensor:
        """Pairs with expert id >= 0: from their slot when cached, else staged from host memory."""
        pool = self.pools.get(self.group_of[layer])
        out = expert_ffn(x, tokens, torch.where(experts >= 0, slots, -1), weights, pool) if pool is not None \
            else torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        missed = experts[(experts >= 0) & (slots < 0)].unique().cpu()
        if missed.numel():
            out = out + self._staged(layer, x, tokens, experts, weights, missed)
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
                 pools: Mapping[int, ExpertWeights], group_of: Mapping[int, int], device: torch.device,
                 stage_misses: bool = True) -> None:
        from ops.triton import grouped_expert_ffn, stage_experts, tables_from_bank  # Triton: CUDA only

        self.grouped_ffn, self.stage = grouped_expert_ffn, stage_experts
        self.host, self.pools, self.group_of = host, pools, group_of
        self.resident = {layer: tables_from_bank(bank, device) for layer, bank in resident.items()}
        # NOTE: a host layer's table starts all-host; `update` points cached experts at their slots.
        self._host_tables = StackedTables({layer: tables_from_bank(bank, device) for layer, bank in host.items()})
        self.tables = self._host_tables.views
        # the same with staging rows for host memory: one staging bank per expert shape, reused by every
        # layer of that shape (the compute stream orders a layer's copies after the last layer's reads)
        self.staging = {shape: empty_bank(bank, bank.num_experts, device)
                        for shape, bank in _one_per_shape(host.values()).items()} if stage_misses else {}
        self._staged_tables = StackedTables({layer: tables_from_bank(self._staging_of(layer), device)
                                             for layer in host} if stage_misses else {})
        self.staged = self._staged_tables.views

    def _staging_of(self, layer: int) -> ExpertWeights:
        return self.staging[bank_shape(self.host[layer])]

    def resident_ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # x's dtype: no conversion launch
        return self.grouped_ffn(x, tokens, experts, weights, self.resident[layer], out)

    def ffn(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """Pairs with expert id >= 0, through the layer's table: hits from their slots, misses copied to
        staging rows first (or, without staging, read from host memory in place)."""
        staged = self.staged.get(layer)
        if staged is None:
            return self.grouped_ffn(x, tokens, experts, weights, self.tables[layer])
        self.stage(experts, self.tables[layer], staged)
        return self.grouped_ffn(x, tokens, experts, weights, staged)

    def update(self, entries: list[tuple[int, int, int]]) -> None:
        """(layer, expert, slot or -1): point each expert at its slot, or back at host memory (and at its
        staging row in the staged tables)."""
        def addresses(layer: int, expert: int, slot: int, uncached: ExpertWeights) -> tuple[int, int, int]:
            bank, row = (self.pools[self.group_of[layer]], slot) if slot >= 0 else (uncached, expert)
            return _row_address(bank.gate, row), _row_address(bank.up, row), _row_address(bank.down, row)

        self._host_tables.set([(layer, e, addresses(layer, e, slot, self.host[layer])) for layer, e, slot in entries])
        if self.staged:
            self._staged_tables.set([(layer, e, addresses(layer, e, slot, self._staging_of(layer)))
                                     for layer, e, slot in entries])


class StackedTables:
    """Pointer tables of several layers as views of one device tensor `[layers, 3 (gate, up, down),
    experts]`: the changes of a step are one host -> device copy and one indexed write."""

    def __init__(self, per_layer: Mapping[int, ExpertTables]) -> None:
        self.row = {layer: i for i, layer in enumerate(per_layer)}
        self.ptrs: torch.Tensor | None = None
        self.views: dict[int, ExpertTables] = {}
        if per_layer:
            ptrs = torch.stack([torch.stack([t.gate_ptrs, t.up_ptrs, t.down_ptrs]) for t in per_layer.values()])
            self.ptrs = ptrs
            self.views = {layer: replace(t, gate_ptrs=ptrs[i, 0], up_ptrs=ptrs[i, 1], down_ptrs=ptrs[i, 2])
                          for i, (layer, t) in enumerate(per_layer.items())}

    def set(self, entries: list[tuple[int, int, tuple[int, int, int]]]) -> None:
        """(layer, expert, its gate, up and down addresses); of repeated (layer, expert), the last counts."""
        latest = {(layer, expert): address for layer, expert, address in entries}
        if not latest or self.ptrs is None:
            return
        packed = torch.tensor([(self.row[layer], expert, *address) for (layer, expert), address in latest.items()],
                              dtype=torch.int64).to(self.ptrs.device)
        self.ptrs[packed[:, 0], :, packed[:, 1]] = packed[:, 2:]


def _one_per_shape(banks: Iterable[ExpertWeights]) -> dict[tuple, ExpertWeights]:
    return {bank_shape(bank): bank for bank in banks}


def staging_bytes(banks: Iterable[ExpertWeights]) -> int:
    """VRAM of the staging banks `TableCompute` allocates for these host banks (one per expert shape)."""
    return sum(bank.num_experts * bank.expert_bytes for bank in _one_per_shape(banks).values())


def _row_address(bank_part: torch.Tensor, row: int) -> int:
    return bank_part.data_ptr() + row * bank_part.stride(0)


def make_compute(host: Mapping[int, ExpertWeights], resident: Mapping[int, ExpertWeights],
                 pools: Mapping[int, ExpertWeights], group_of: Mapping[int, int],
                 device: torch.device, stage_misses: bool = True) -> BankCompute | TableCompute:
    """Pointer tables on CUDA when Triton is available; banks otherwise. `stage_misses`: the device
    computes missed experts (stream and hybrid modes) and stages them in VRAM first."""
    if device.type == "cuda" and triton_available():
        return TableCompute(host, resident, pools, group_of, device, stage_misses)
    return BankCompute(host, resident, pools, group_of, device)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
