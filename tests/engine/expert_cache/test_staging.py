"""A prompt's staging plan (`engine.expert_cache.staging.LayerStager`), checked on the CPU: the runs of a layer's
experts (consecutive uncached ones together, each cached one alone) and, for the gather launch, the address each
expert's bytes are read from (read back here through ctypes, not recomputed). The copies themselves are CUDA's
(tests/engine/test_gpu_engine.py, tests/ops/test_triton_stage.py)."""

from __future__ import annotations

import ctypes

import torch

from engine.expert_cache.device import expert_parts
from engine.expert_cache.staging import LayerStager
from ops.bank import ExpertWeights
from ops.quants import QType


def bank(num_experts: int, seed: int) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    part = lambda rows: torch.randint(0, 256, (num_experts, rows, 144), dtype=torch.uint8,  # noqa: E731
                                      generator=generator)
    return ExpertWeights(part(256), part(256), part(256), QType.Q4_K, QType.Q4_K, QType.Q4_K, 256, 256)


def test_cached_experts_are_read_from_their_slots_and_the_rest_from_host_memory() -> None:
    host, pool = bank(8, 0), bank(3, 1)
    slots = [-1, -1, 2, -1, 0, -1, -1, 1]  # experts 2, 4 and 7 cached in slots 2, 0 and 1
    stager = LayerStager({5: host}, {0: pool}, {5: 0}, lambda layer: slots, copies=None)  # type: ignore[arg-type]
    runs = stager.runs(5)
    assert runs == [(0, 2, -1), (2, 3, 2), (3, 4, -1), (4, 5, 0), (5, 7, -1), (7, 8, 1)]
    sources = stager.sources(5, runs)
    for expert, slot in enumerate(slots):
        want = expert_parts(pool, slot) if slot >= 0 else expert_parts(host, expert)
        for i, part in enumerate(want):
            got = ctypes.string_at(sources[i][expert], part.numel())
            assert got == part.numpy().tobytes(), f"expert {expert}, part {i}"
