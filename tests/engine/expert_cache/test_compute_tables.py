"""The pointer tables of `TableCompute`: every host layer's tables are views of one stacked tensor, and a
step's changes point each expert at its slot, or back at host memory (plain tables) and at its staging
row (staged tables). Pointer bookkeeping only: it runs on CPU tensors, no kernel is launched."""

from __future__ import annotations

import pytest
import torch

from engine.expert_cache.compute import TableCompute
from engine.expert_cache.device import empty_bank
from ops.cpu_experts import ExpertWeights
from ops.quants import QType, random_blocks

pytest.importorskip("triton", reason="triton is not installed: the pointer-table compute needs it")

CPU = torch.device("cpu")


def bank(num_experts: int, hidden: int = 256, ff: int = 256) -> ExpertWeights:
    g = torch.Generator().manual_seed(num_experts)
    part = lambda rows, cols: random_blocks(QType.Q8_0, num_experts * rows * cols // 32, g).view(num_experts, rows, -1)  # noqa: E731
    return ExpertWeights(part(ff, hidden), part(ff, hidden), part(hidden, ff), QType.Q8_0, QType.Q8_0, QType.Q8_0,
                         hidden, ff)


def address(b: ExpertWeights, row: int) -> tuple[int, int, int]:
    return tuple(t.data_ptr() + row * t.stride(0) for t in (b.gate, b.up, b.down))


def pointed(tables, expert: int) -> tuple[int, int, int]:  # noqa: ANN001
    return tuple(int(p[expert]) for p in (tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs))


@pytest.fixture
def compute() -> TableCompute:
    host = {1: bank(8), 3: bank(8)}
    pool = empty_bank(host[1], 4, CPU)
    return TableCompute(host, {}, {0: pool}, {1: 0, 3: 0}, CPU)


def test_tables_start_at_host_memory_and_staging_rows(compute: TableCompute) -> None:
    (staging,) = compute.staging.values()
    for layer in (1, 3):
        for expert in range(8):
            assert pointed(compute.tables[layer], expert) == address(compute.host[layer], expert)
            assert pointed(compute.staged[layer], expert) == address(staging, expert)


def test_a_step_of_changes_points_experts_at_slots_and_back(compute: TableCompute) -> None:
    pool, (staging,) = compute.pools[0], compute.staging.values()
    compute.update([(1, 2, 0), (3, 2, 1), (3, 7, 3)])
    for layer, expert, slot in ((1, 2, 0), (3, 2, 1), (3, 7, 3)):
        assert pointed(compute.tables[layer], expert) == address(pool, slot)
        assert pointed(compute.staged[layer], expert) == address(pool, slot)
    assert pointed(compute.tables[1], 7) == address(compute.host[1], 7)  # other experts unchanged
    compute.update([(3, 7, -1), (1, 2, -1), (1, 2, 2)])  # unpublished, then published again: the last counts
    assert pointed(compute.tables[3], 7) == address(compute.host[3], 7)
    assert pointed(compute.staged[3], 7) == address(staging, 7)
    assert pointed(compute.tables[1], 2) == address(pool, 2)
    assert pointed(compute.tables[3], 2) == address(pool, 1)


def test_without_staging_only_the_plain_tables_exist() -> None:
    host = {0: bank(4)}
    compute = TableCompute(host, {}, {0: empty_bank(host[0], 2, CPU)}, {0: 0}, CPU, stage_misses=False)
    assert not compute.staging and not compute.staged
    compute.update([(0, 1, 1)])
    assert pointed(compute.tables[0], 1) == address(compute.pools[0], 1)
