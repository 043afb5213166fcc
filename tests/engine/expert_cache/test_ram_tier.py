"""The host-RAM tier in front of the GGUF file (`--ssd-moe`): its slots and LRU, its reads (equal to the map's
bytes, each missed expert read once), its expert FFN, its flags and the placement they give."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import CacheConfig
from engine.expert_cache.placement import choose_placement
from engine.expert_cache.ram_tier import RamTier, SlotLru, _read_fully, coalesce
from engine.expert_cache.stats import CacheStats
from engine.gguf.reader import GGUFFile
from engine.weights import ModelWeights, MoE, load_weights
from ops.expert_ffn import expert_ffn

MiB = 1 << 20


# -- the slots: torch-free ----------------------------------------------------------------------------------------
def test_lru_fills_free_slots_then_evicts_the_least_recently_used() -> None:
    lru = SlotLru(3)
    assert lru.place(["a", "b", "c"]) == ([0, 1, 2], [("a", 0), ("b", 1), ("c", 2)])
    assert lru.place(["a"]) == ([0], [])  # a hit refreshes a
    assert lru.place(["d"]) == ([1], [("d", 1)])  # b was the least recently used
    assert lru.residents() == {"c": 2, "a": 0, "d": 1}


def test_keys_of_one_call_never_evict_one_another() -> None:
    lru = SlotLru(2)
    lru.place(["a", "b"])
    slots, missed = lru.place(["b", "c"])  # c must not take b's slot, though b is older than a before the call
    assert slots == [1, 0] and missed == [("c", 0)]
    with pytest.raises(ValueError, match="3 experts at once in a RAM tier of 2 slots"):
        lru.place(["x", "y", "z"])


def test_a_forgotten_key_frees_its_slot_and_is_read_again() -> None:
    lru = SlotLru(2)
    lru.place(["a"])
    lru.forget(["a"])
    assert lru.place(["a", "b"])[1] == [("a", 0), ("b", 1)]


def test_adjacent_ranges_are_read_in_one_call() -> None:
    buffers = [memoryview(bytearray(n)) for n in (4, 4, 8)]
    reads = coalesce([(100, 4), (104, 4), (200, 8)], buffers)
    assert [(offset, [len(b) for b in bufs]) for offset, bufs in reads] == [(100, [4, 4]), (200, [8])]


def test_short_reads_continue_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)))
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: real(fd, [bufs[0][:3]], offset))  # 3 bytes a call
    a, b = bytearray(5), bytearray(4)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _read_fully(fd, 10, [memoryview(a), memoryview(b)]) == 4  # 3 + 2 bytes of a, 3 + 1 of b
    finally:
        os.close(fd)
    assert bytes(a + b) == bytes(range(10, 19))


# -- the tier over a real GGUF file -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf(small_moe_gguf: Path) -> GGUFFile:
    return GGUFFile(small_moe_gguf)


@pytest.fixture(scope="module")
def weights(gguf: GGUFFile) -> ModelWeights:
    return load_weights(gguf, torch.device("cpu"), torch.float32)


def make_tier(weights: ModelWeights, gguf: GGUFFile, num_slots: int, stats: CacheStats | None = None) -> RamTier:
    layouts = {i: ffn.experts for i in weights.moe_layers if isinstance(ffn := weights.layers[i].ffn, MoE)}
    expert = next(iter(layouts.values())).expert_bytes
    return RamTier(layouts, gguf.locate, num_slots * expert, weights.hparams.top_k, stats or CacheStats())


def test_an_expert_read_from_disk_equals_the_maps_bytes_and_is_read_once(weights: ModelWeights,
                                                                           gguf: GGUFFile) -> None:
    stats = CacheStats()
    tier = make_tier(weights, gguf, 6, stats)
    bank = tier.layouts[1]
    for parts in (tier.expert(1, 5), tier.expert(1, 5)):
        for got, want in zip(parts, (bank.gate[5], bank.up[5], bank.down[5])):
            assert torch.equal(got, want)
    snap = stats.snapshot()
    assert (snap.ram_hits, snap.ram_misses, snap.disk_read_bytes) == (1, 1, bank.expert_bytes)
    assert snap.disk_reads == 3  # gate, up and down: three tensors, three ranges
    tier.close()


def test_a_slot_evicted_and_refilled_holds_the_new_experts_bytes(weights: ModelWeights, gguf: GGUFFile) -> None:
    tier = make_tier(weights, gguf, 4)
    first = tier.load(0, [0, 1, 2, 3])
    slots = tier.load(2, [7, 8])  # evicts layer 0's experts 0 and 1
    assert slots == first[:2]
    bank = tier.banks[2]
    assert torch.equal(bank.down[slots[1]], tier.layouts[2].down[8])
    tier.close()


def test_tier_ffn_equals_the_map_bank_with_more_experts_than_slots(weights: ModelWeights, gguf: GGUFFile) -> None:
    tier = make_tier(weights, gguf, 4)  # 16 experts a layer, 4 slots: computed four at a time
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((6, weights.hparams.hidden)).astype(np.float32))
    tokens = torch.arange(6).repeat_interleave(4)
    experts = torch.from_numpy(rng.integers(-1, 16, 24))
    w = torch.rand(24)
    want = expert_ffn(x, tokens, experts, w, tier.layouts[3])
    got = tier.ffn(3, x, tokens, experts, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    tier.close()


def test_a_tier_smaller_than_one_tokens_experts_names_the_size_needed(weights: ModelWeights, gguf: GGUFFile) -> None:
    with pytest.raises(ValueError, match="a layer needs 4 at once: give --host-cache-mib >= 1"):
        make_tier(weights, gguf, 3)


# -- flags and placement ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(n_ssd_moe=-1), "--n-ssd-moe must be >= 0"),
    (dict(ssd_moe=True, n_ssd_moe=2), "not both"),
    (dict(host_cache_mib=64), "give one of them"),
    (dict(ssd_moe=True, host_cache_mib=0), "--host-cache-mib must be >= 1 MiB"),
])
def test_disk_flags_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_disk_layers_are_host_layers_and_the_rest_stay_resident() -> None:
    layer_bytes = {i: 100 * MiB for i in range(4)}
    cpu = choose_placement(layer_bytes, CacheConfig(n_ssd_moe=2), free_bytes=None)
    assert (cpu.disk_layers, cpu.host_layers, cpu.resident_layers) == ((0, 1), (0, 1), (2, 3))
    assert cpu.reason.startswith("--n-ssd-moe 2: 2 layers' routed experts on disk")
    every = choose_placement(layer_bytes, CacheConfig(ssd_moe=True, n_cpu_moe=1), free_bytes=None)
    assert every.disk_layers == every.host_layers == (0, 1, 2, 3) and "--n-cpu-moe 1" in every.reason
    assert choose_placement(layer_bytes, CacheConfig(), free_bytes=None).disk_layers == ()


def test_demoted_keys_are_evicted_first() -> None:
    lru = SlotLru(3)
    lru.place(["a", "b", "c"])
    lru.demote(["c", "missing"])  # c: the most recent, now the first to go; a key not held is ignored
    _, missed = lru.place(["d"])
    assert missed == [("d", 2)] and set(lru.residents()) == {"a", "b", "d"}


def test_the_tier_takes_back_at_most_what_it_holds(weights: ModelWeights, gguf: GGUFFile) -> None:
    """More evicted experts of a layer than the tier has slots (a prompt's reservation can evict a whole layer's
    cache): it takes the last of them, each with the bytes it was given, and reads nothing."""
    stats = CacheStats()
    tier = make_tier(weights, gguf, weights.hparams.top_k + 1, stats)
    bank = tier.layouts[1]
    given = {e: tuple(torch.full_like(t[e], e) for t in (bank.gate, bank.up, bank.down))
             for e in range(tier.num_slots + 2)}
    tier.keep(1, given)
    assert set(tier.lru.residents()) == {(1, e) for e in range(2, tier.num_slots + 2)}
    for key, slot in tier.lru.residents().items():
        for t in (tier.banks[1].gate, tier.banks[1].up, tier.banks[1].down):
            assert int(t[slot].min()) == int(t[slot].max()) == key[1]  # type: ignore[index]
    snap = stats.snapshot()
    assert snap.ram_kept == tier.num_slots and snap.disk_reads == 0
    tier.close()
