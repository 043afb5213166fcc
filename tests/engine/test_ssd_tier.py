"""Routed experts on disk behind the host-RAM tier (`--ssd-moe`), on the CPU device: the same greedy tokens as
with every expert in RAM, every miss mode; the tier's counts add up; and a model whose experts are three
times the tier's budget runs in a process whose anonymous memory holds no more than the budget of them."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from tools.synth import PRESETS, with_overrides, write_synth

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def greedy(path: Path, cache: CacheConfig) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=128), cache=cache,
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


@dataclass
class Peaks:
    anon: int = 0  # RssAnon: the process's own memory (heap, the RAM tier, the dense weights)
    file: int = 0  # RssFile: mapped file pages (shared libraries, the GGUF map)
    map: int = 0  # Rss of the GGUF file's mapping


def _sample(pid: int, model: Path, peaks: Peaks, with_map: bool) -> None:
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        peaks.anon = max(peaks.anon, int(status["RssAnon"].split()[0]) * 1024)
        peaks.file = max(peaks.file, int(status["RssFile"].split()[0]) * 1024)
        if not with_map:
            return
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
    """`moecache generate` in a subprocess, its memory sampled every 10 ms (the map's every 100 ms)."""
    cmd = [sys.executable, "-m", "service.cli", "generate", "-m", str(model), "--device", "cpu", "-p",
           "Once upon a time", "-n", "8", "--temperature", "0", "--ignore-eos", "-c", "64", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks, samples = Peaks(), 0
    while proc.poll() is None:
        _sample(proc.pid, model, peaks, with_map=samples % 10 == 0)
        samples += 1
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
    margin = ram.anon - dense_bytes + 32 * MiB  # the rest of the process, as measured, and 32 MiB of slack
    assert disk.anon <= budget + dense_bytes + margin, (disk, ram)
    # NOTE: the map's expert pages are never faulted in: the file's mapping holds its dense tensors (read once
    # at load) and what fault-around brings in beside them, never the experts
    assert disk.map <= in_file_dense + 16 * MiB < ram.map, (disk, ram)
