"""A prompt's staging plan (`engine.expert_cache.staging.LayerStager`), checked on the CPU: the runs of a layer's
experts (consecutive uncached ones together, each cached one alone) and, for the gather launch, the address each
expert's bytes are read from (read back here through ctypes, not recomputed). The copies themselves are CUDA's
(tests/engine/test_gpu_engine.py, tests/ops/test_triton_stage.py)."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from engine.expert_cache.device import CopyEngine, empty_bank, expert_parts
from engine.expert_cache.staging import LayerStager
from ops.bank import ExpertWeights
from ops.expert_math import ExpertMath
from ops.quants import QType


def bank(num_experts: int, seed: int) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    part = lambda rows: torch.randint(0, 256, (num_experts, rows, 144), dtype=torch.uint8,  # noqa: E731
                                      generator=generator)
    return ExpertWeights(part(256), part(256), part(256), QType.Q4_K, QType.Q4_K, QType.Q4_K, 256, 256)


def test_cached_experts_are_read_from_their_slots_and_the_rest_from_host_memory() -> None:
    host, pool = bank(8, 0), bank(3, 1)
    slots = [-1, -1, 2, -1, 0, -1, -1, 1]  # experts 2, 4 and 7 cached in slots 2, 0 and 1
    stager = LayerStager({5: host}, {0: pool}, {5: 0}, lambda layer: slots, copies=CopyEngine(torch.device("cpu")))
    runs = stager.runs(5)
    assert runs == [(0, 2, -1), (2, 3, 2), (3, 4, -1), (4, 5, 0), (5, 7, -1), (7, 8, 1)]
    sources = stager.sources(5, runs, host)
    for expert, slot in enumerate(slots):
        want = expert_parts(pool, slot) if slot >= 0 else expert_parts(host, expert)
        for i, part in enumerate(want):
            got = ctypes.string_at(sources[i][expert], part.numel())
            assert got == part.numpy().tobytes(), f"expert {expert}, part {i}"


def test_a_staged_layer_reads_cached_experts_in_their_slots_and_copies_only_the_rest() -> None:
    """In place: the staging copies the uncached runs alone, and the layer's tables address each cached expert in its
    slot and each other one in the staging buffer at its own row, with the layer's expert math. Whole: every run is
    copied and the tables address the buffer only."""
    host, pool, buffer = bank(8, 0), bank(3, 1), bank(8, 2)
    host = replace(host, math=ExpertMath("gelu", None, None, torch.randn(8, 256)))
    slots = [-1, -1, 2, -1, 0, -1, -1, 1]
    for in_place in (True, False):
        stager = LayerStager({5: host}, {0: pool}, {5: 0}, lambda layer: slots, copies=CopyEngine(torch.device("cpu")),
                             in_place=in_place)
        copied = stager.copied_runs(5)
        assert copied == ([(0, 2, -1), (3, 4, -1), (5, 7, -1)] if in_place else stager.runs(5))
        tables = stager.tables(5, buffer)
        assert tables.math.activation == "gelu" and torch.equal(tables.math.down_bias, host.math.down_bias)
        for expert, slot in enumerate(slots):
            want = expert_parts(pool, slot) if slot >= 0 and in_place else expert_parts(buffer, expert)
            for part, ptrs in zip(want, (tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs), strict=True):
                got = ctypes.string_at(int(ptrs[expert]), part.numel())
                assert got == part.numpy().tobytes(), f"expert {expert} (in place: {in_place})"


def test_a_layer_read_wholly_in_place_takes_no_buffer() -> None:
    """In place, layers whose experts are all cached copy nothing: each is handed its host bank (its tables name only
    slots), none takes a staging buffer or waits for a copy, and handing it back records nothing."""
    host, pool = {5: bank(4, 0), 6: bank(4, 1)}, bank(8, 2)
    slots = {5: [0, 1, 2, 3], 6: [4, 5, 6, 7]}
    stager = LayerStager(host, {0: pool}, {5: 0, 6: 0}, lambda layer: slots[layer],
                         copies=CopyEngine(torch.device("cpu")), in_place=True)
    first = stager.bank(5)
    assert first is host[5] and stager.ready == {6: (host[6], None)}  # the next layer, marked ready as well
    stager.release(first)
    assert stager.bank(6) is host[6] and not stager.ready and not stager.buffers and not stager.free
    tables = stager.tables(6, host[6])
    for expert, slot in enumerate(slots[6]):
        part = expert_parts(pool, slot)[0]
        assert ctypes.string_at(int(tables.gate_ptrs[expert]), part.numel()) == part.numpy().tobytes()
    stager.finish()


@pytest.mark.gpu
@pytest.mark.parametrize("spare", [None, 0], ids=["two-buffers", "memory-to-spare"])
def test_layers_after_cached_ones_are_staged_as_far_ahead_as_buffers_allow(spare: int | None) -> None:
    """A prompt's first two host layers wholly cached, the next four not: handing out the first stages the four
    uncached layers at once where the device has memory to spare (a buffer each), two without; each layer then holds
    its own experts, also in a second prompt that refills the buffers, the one filled longest ago first."""
    cuda = torch.device("cuda")
    host = {layer: ExpertWeights(*(t.pin_memory() for t in expert_parts(b, slice(None))), b.gate_type, b.up_type,
                                 b.down_type, b.hidden, b.ff) for layer, b in ((x, bank(4, x)) for x in range(6))}
    pool = empty_bank(host[0], 8, cuda)
    for layer in (0, 1):
        for dst, src in zip(expert_parts(pool, slice(4 * layer, 4 * layer + 4)),
                            expert_parts(host[layer], slice(None))):
            dst.copy_(src)
    slots = {layer: [4 * layer + e for e in range(4)] if layer < 2 else [-1] * 4 for layer in range(6)}
    stager = LayerStager(host, {0: pool}, dict.fromkeys(host, 0), lambda layer: slots[layer], CopyEngine(cuda),
                         in_place=True, spare_bytes=spare)
    for _ in range(2):  # two prompts
        stager.release(stager.bank(0))
        ahead = [layer for layer, (_, copied) in stager.ready.items() if copied is not None]
        assert ahead == ([2, 3, 4, 5] if spare == 0 else [2, 3])
        for layer in range(1, 6):
            buffer = stager.bank(layer)
            if layer >= 2:
                for got, want in zip(expert_parts(buffer, slice(None)), expert_parts(host[layer], slice(None))):
                    assert torch.equal(got.cpu(), want), f"layer {layer}"
            stager.release(buffer)
        stager.finish()
        assert len(next(iter(stager.buffers.values()))) == (4 if spare == 0 else 2)
