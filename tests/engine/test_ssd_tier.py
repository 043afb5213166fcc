"""Routed experts on disk behind the host-RAM tier (`--ssd-moe`): the same greedy tokens as with every expert in
RAM, every miss mode, on the CPU device and on CUDA; the tier's counts add up; a disk layer's misses are read once
and the host pointer table the CUDA kernels stream from points at their RAM slots; and a model whose experts are
three times the tier's budget runs in a process whose anonymous memory holds no more than the budget of them."""

from __future__ import annotations

import ctypes
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from tools.synth import PRESETS, with_overrides, write_synth

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def greedy(path: Path, cache: CacheConfig, device: str = "cpu") -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(path), device=device, max_context=128), cache=cache,
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)))
    for i in range(3):
        engine.add_request(Request(f"r{i}", tuple(engine.tokenizer.encode(f"hello number {i}")),
                                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.cache.flush()
    return out, engine


@pytest.mark.parametrize("cache", [
    CacheConfig(ssd_moe=True, host_cache_mib=1),  # 9 slots for 4 layers x 16 experts: the tier thrashes
    CacheConfig(ssd_moe=True, host_cache_mib=1, budget_mib=1, miss_mode="stream", policy="lru"),
    CacheConfig(n_ssd_moe=2, host_cache_mib=4, budget_mib=1, miss_mode="hybrid"),
], ids=["cpu", "stream", "hybrid-2-layers"])
def test_experts_on_disk_give_the_same_tokens_as_in_ram(small_moe_gguf: Path, cache: CacheConfig) -> None:
    expected, reference = greedy(small_moe_gguf, CacheConfig())
    reference.close()
    got, engine = greedy(small_moe_gguf, cache)
    snap, tier = engine.cache.snapshot(), engine.cache.tier
    assert tier is not None and engine.cache.placement.disk_layers == (0, 1, 2, 3)[:2 if cache.n_ssd_moe else 4]
    _, where = engine.cache.usage_snapshot()  # the web page's cache view: on disk only (-2), or in RAM (0)
    in_ram = {(int(layer), int(e)) for layer, e in zip(*np.nonzero(where == 0))}
    assert (where == -2).any() and in_ram and in_ram <= set(tier.lru.residents())
    engine.close()
    assert got == expected
    assert snap.ram_misses > 0 and snap.disk_read_bytes == snap.ram_misses * tier.slot_bytes
    assert snap.disk_reads == 3 * snap.ram_misses  # gate, up, down: three ranges of three tensors


def assert_tier_holds_the_files_bytes(engine: LLMEngine) -> None:
    tier, mapped = engine.cache.tier, engine.store.mapped
    assert tier is not None
    for key, slot in tier.lru.residents().items():
        layer, e = cast(tuple[int, int], key)
        bank, file = tier.banks[layer], mapped[layer]
        for part, t in zip((bank.gate, bank.up, bank.down), (file.gate, file.up, file.down)):
            assert torch.equal(part[slot].reshape(-1), t[e].reshape(-1)), (layer, e)


def test_the_tier_takes_back_what_the_device_cache_evicts_with_the_files_bytes(small_moe_gguf: Path) -> None:
    """The tier exclusive of the cache: experts the cache evicts are copied back into the tier from their slots, and
    every expert the tier holds afterwards (read from disk or taken back) is byte for byte the file's."""
    got, engine = greedy(small_moe_gguf, CacheConfig(ssd_moe=True, host_cache_mib=2, budget_mib=1, miss_mode="stream",
                                                     policy="lru"))
    snap = engine.cache.snapshot()
    assert snap.evictions > 0 and snap.ram_kept > 0
    assert_tier_holds_the_files_bytes(engine)
    engine.close()
    expected, reference = greedy(small_moe_gguf, CacheConfig())
    reference.close()
    assert got == expected


def test_a_disk_layers_misses_are_read_once_and_the_host_table_points_at_their_ram_slots(
        small_moe_gguf: Path) -> None:
    """What a CUDA decode step does before a disk layer's kernels (`read_disk_misses`), run on the CPU device's
    tables: the experts no slot holds are read into the tier, once; one a slot holds is not read; and the host
    table's gate, up and down addresses hold the map's bytes of each expert read."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu", max_context=64),
                                    cache=CacheConfig(ssd_moe=True, host_cache_mib=4, budget_mib=1, miss_mode="stream",
                                                      policy="lru")))
    dispatcher, tier = engine.cache.dispatcher, engine.cache.tier
    assert tier is not None and not dispatcher.is_graph_safe
    layer, tables = 1, engine.cache.manager.tables
    row = dispatcher.rows[layer]
    assert int(tables.host[row].abs().sum()) == 0  # no address before a read: never the map's
    tables.state[row][5] = 0  # expert 5 in a VRAM slot: a hit, not read
    dispatcher.read_disk_misses(layer, torch.tensor([[3, 5, 7, -1], [7, 3, 9, 5]]))
    snap = engine.cache.snapshot()
    assert set(tier.lru.residents()) == {(layer, 3), (layer, 7), (layer, 9)}
    assert (snap.ram_hits, snap.ram_misses, snap.disk_read_bytes) == (0, 3, 3 * tier.slot_bytes)
    mapped = engine.store.mapped[layer]
    for e in (3, 7, 9):
        for part, t in enumerate((mapped.gate, mapped.up, mapped.down)):
            got = ctypes.string_at(int(tables.host[row, part, e]), t[e].numel())
            assert got == t[e].numpy().tobytes(), (e, part)
    assert int(tables.host[row, :, 5].abs().sum()) == 0
    dispatcher.read_disk_misses(layer, torch.tensor([[9, 3, 5, 7]]))  # all in RAM (or a slot): no read
    again = engine.cache.snapshot()
    assert (again.ram_hits, again.ram_misses, again.disk_reads) == (3, 3, snap.disk_reads)
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("miss_mode", ["stream", "cpu"])
def test_experts_on_disk_give_the_same_tokens_on_cuda(small_moe_gguf: Path, miss_mode: str) -> None:
    """On CUDA: misses streamed from the pinned tier's slots (read there first), CPU misses through the tier,
    prompts staged from it; the tokens equal those with every expert pinned in RAM and the same cache."""
    cache = CacheConfig(cpu_moe=True, budget_mib=1, miss_mode=miss_mode, policy="lru")
    expected, reference = greedy(small_moe_gguf, cache, "cuda")
    assert reference.launches_async  # no host sync in a step: its outputs wait for the next launch (AsyncEngine)
    reference.close()
    host_cache_mib = 1  # 9 slots: a token's top-k fit, the CPU reads through the tier a token at a time
    if miss_mode == "stream":  # the kernels stream a decode step's misses of a layer at once: all 16 may be selected
        with pytest.raises(ValueError, match="a layer needs 16 at once"):
            greedy(small_moe_gguf, replace(cache, ssd_moe=True, host_cache_mib=1), "cuda")
        host_cache_mib = 2
    got, engine = greedy(small_moe_gguf, replace(cache, ssd_moe=True, host_cache_mib=host_cache_mib), "cuda")
    assert not engine.launches_async  # a disk layer syncs the host inside the step: outputs go at once
    snap = engine.cache.snapshot()
    assert_tier_holds_the_files_bytes(engine)  # those read and those taken back from the device's slots
    engine.close()
    assert got == expected
    assert snap.ram_misses > 0 and snap.disk_read_bytes > 0 and snap.evictions > 0 and snap.ram_kept > 0


@dataclass
class Peaks:
    anon: int = 0  # RssAnon: the process's own memory (heap, the RAM tier, the dense weights)
    file: int = 0  # RssFile: mapped file pages (shared libraries, the GGUF map)
    map: int = 0  # Rss of the GGUF file's mapping


def _sample(pid: int, model: Path, peaks: Peaks) -> None:
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        peaks.anon = max(peaks.anon, int(status["RssAnon"].split()[0]) * 1024)
        peaks.file = max(peaks.file, int(status["RssFile"].split()[0]) * 1024)
        mapped, inside = 0, False
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header line
                inside = line.endswith(str(model))
            elif inside and line.startswith("Rss:"):
                mapped += int(line.split()[1]) * 1024
        peaks.map = max(peaks.map, mapped)
    except (OSError, KeyError):  # the process is exiting
        pass


def generate(model: Path, *flags: str) -> tuple[str, Peaks]:
    """`moecache generate` in a subprocess, its memory and its map's sampled every 10 ms. NOTE: the map every 10th
    sample once missed the in-RAM run's expert pages on a loaded machine (its last sample came before them)."""
    cmd = [sys.executable, "-m", "service.cli", "generate", "-m", str(model), "--device", "cpu", "-p",
           "Once upon a time", "-n", "8", "--temperature", "0", "--ignore-eos", "-c", "64", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = Peaks()
    while proc.poll() is None:
        _sample(proc.pid, model, peaks)
        time.sleep(0.01)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    return out, peaks


def test_a_model_three_times_the_ram_budget_holds_only_the_budget(tmp_path: Path, vocab: dict) -> None:
    """Routed experts 432 MiB (8 layers x 32 experts of 1.69 MiB, Q4_K), the tier 144 MiB. Asserted on RssAnon,
    the memory the process owns: the page cache (file pages the reads or the map bring in) is the kernel's to
    drop and is not counted. The dense weights and everything else the process holds (the interpreter, torch,
    the KV cache) are measured by the run with every expert in RAM, where the experts are the map's file pages."""
    model = tmp_path / "big.gguf"
    preset = with_overrides(PRESETS["embedded"], hidden=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                            expert_ff=1024)
    write_synth(model, preset, vocab, seed=3)
    gguf = GGUFFile(model)
    expert_bytes = sum(t.num_bytes for t in gguf if "_exps" in t.name)
    dense_bytes = sum(math.prod(t.shape) * 4 for t in gguf if "_exps" not in t.name)  # float32 on the CPU
    in_file_dense = gguf.file_bytes - expert_bytes
    budget = expert_bytes // 3
    assert 400 * MiB < expert_bytes < 500 * MiB and dense_bytes < 128 * MiB

    in_ram, ram = generate(model)
    on_disk, disk = generate(model, "--ssd-moe", "--host-cache-mib", str(budget // MiB))
    print(f"budget {budget / MiB:.0f} MiB, dense {dense_bytes / MiB:.0f} MiB; peaks in MiB (anon, file, map): "
          f"in RAM {ram.anon / MiB:.0f}, {ram.file / MiB:.0f}, {ram.map / MiB:.0f}; on disk {disk.anon / MiB:.0f}, "
          f"{disk.file / MiB:.0f}, {disk.map / MiB:.0f}")
    assert on_disk == in_ram  # greedy: the same tokens
    # NOTE: the rest of the process is the in-RAM run's peak; two runs' peaks differ by up to ~80 MiB (the allocator's
    # arenas), hence 128 MiB of slack, well under the 288 MiB more that every expert held in anonymous memory would add
    margin = ram.anon - dense_bytes + 128 * MiB
    assert disk.anon <= budget + dense_bytes + margin, (disk, ram)
    # NOTE: the map's expert pages are never faulted in: the file's mapping holds its dense tensors (read once
    # at load) and what fault-around brings in beside them, never the experts
    assert disk.map <= in_file_dense + 16 * MiB < ram.map, (disk, ram)
