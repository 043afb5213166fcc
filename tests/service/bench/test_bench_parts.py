"""The pieces of `moecache bench` with hand-made inputs: sweep lists, budgets, the bound, the accounting."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.arch.base import GLOBAL_TENSORS
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.moe import TopKRouter
from engine.weights import load_weights
from ops.quants import QType
from service.bench.bound import TokenBytes, decode_bound, dense_bytes, token_bytes
from service.bench.ceilings import Ceilings, ExpertShape, measure_ceilings, pinned_bank
from service.bench.results import ConfigResult, Skipped, run_configuration
from service.bench.runner import DECODE, DECODE_PROMPT, PREFILL, CacheDelta, Phase, RunSettings, decode_figures, measure
from service.bench.sweep import MiB, SweepPoint, cache_config, comma_list, fraction, sweep_points
from tools.embedded_vocab import build_embedded_vocab
from tools.routing import ReplayRouter, make_router
from tools.synth import PRESETS, with_overrides, write_synth

GB = 1e9
Q4_K = QType.Q4_K


def ceilings(hbm: float = 1000.0, link: float = 50.0, cpu: float = 50.0) -> Ceilings:
    return Ceilings("test", link, None, hbm, 100.0, cpu, "torch")


def test_comma_lists_parse_and_reject_unknown_choices() -> None:
    assert comma_list(int)("1, 8,32") == [1, 8, 32]
    assert comma_list(str, ("lru", "decay"))("lru,decay") == ["lru", "decay"]
    with pytest.raises(argparse.ArgumentTypeError, match="'fifo' is not one of lru, decay"):
        comma_list(str, ("lru", "decay"))("lru,fifo")
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        comma_list(int)(" , ")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\[0, 1\]"):
        fraction("1.5")


def test_the_sweep_is_the_cartesian_product_with_fractions_replacing_mib() -> None:
    points = sweep_points(["lru", "decay"], ["cpu", "stream", "hybrid"], [0, 4], [100], [0.0, 0.5])
    assert len(points) == 2 * 3 * 2 * 2 and len(set(points)) == len(points)
    assert all(p.budget_mib is None for p in points) and {p.budget_frac for p in points} == {0.0, 0.5}
    assert points[0] == SweepPoint("lru", "cpu", 0, None, 0.0) and points[1].miss_mode == "stream"
    assert {p.budget_mib for p in sweep_points(["lru"], ["cpu"], [0], [0, 64])} == {0, 64}


@pytest.mark.parametrize(("frac", "mib"), [(0.0, 0), (0.25, 3), (1.0, 10)])
def test_a_budget_fraction_rounds_up_to_whole_mib(frac: float, mib: int) -> None:
    host_bytes = 10 * MiB - 4096  # 1.0 must still cover every expert
    cfg = cache_config(SweepPoint("decay", "stream", 2, None, frac), CacheConfig(cpu_moe=True), host_bytes)
    assert cfg.budget_mib == mib
    assert (cfg.policy, cfg.miss_mode, cfg.n_cpu_moe, cfg.cpu_moe) == ("decay", "stream", 2, True)


def test_the_bound_is_the_slower_of_device_memory_and_the_miss_paths() -> None:
    token = TokenBytes(dense=int(1 * GB), host_experts=int(1 * GB), resident_experts=0)
    cold = decode_bound(token, 0.0, ceilings())  # 1 GB of misses over 50 + 50 GB/s: 10 ms
    assert cold.miss_seconds == pytest.approx(0.010) and cold.gpu_floor_seconds == pytest.approx(0.001)
    assert cold.seconds == cold.miss_seconds and cold.tokens_per_second == pytest.approx(100.0)
    warm = decode_bound(token, 1.0, ceilings())  # everything read from device memory: 2 GB / 1000 GB/s
    assert warm.miss_bytes == 0 and warm.seconds == pytest.approx(0.002) == warm.gpu_floor_seconds
    assert warm.share_of(250.0) == pytest.approx(0.5)  # 4 ms measured against a 2 ms bound
    resident = decode_bound(TokenBytes(int(GB), 0, int(GB)), 0.0, ceilings())
    assert resident.miss_seconds == 0 and resident.seconds == pytest.approx(0.002)
    with pytest.raises(ValueError, match="hit ratio"):
        decode_bound(token, 1.5, ceilings())


def test_the_host_bound_takes_the_link_and_the_cpu_at_once() -> None:
    token = TokenBytes(int(GB), int(GB), 0)
    alone = ceilings(link=50.0, cpu=50.0)
    assert decode_bound(token, 0.0, alone).host_seconds is None  # not measured: no host bound
    shared = replace(alone, at_once_gbps=(30.0, 20.0))  # the host gives both 50 GB/s together, not 100
    bound = decode_bound(token, 0.0, shared)
    assert bound.seconds == pytest.approx(0.010) and bound.host_seconds == pytest.approx(0.020)
    assert bound.host_share_of(25.0) == pytest.approx(0.5) and bound.share_of(25.0) == pytest.approx(0.25)
    assert decode_bound(token, 1.0, shared).host_seconds == pytest.approx(0.002)  # no misses: device memory
    # a simulated slower link: the at-once rates were read with the machine's link at full speed, so no host bound
    capped = shared.capped(16.0)
    assert capped.at_once_gbps is None and decode_bound(token, 0.0, capped).host_seconds is None


def test_token_bytes_count_dense_weights_once_and_selected_experts_per_layer(tiny_model: Path) -> None:
    gguf = GGUFFile(tiny_model)
    weights = load_weights(gguf, torch.device("cpu"), torch.float32)
    dense = [t for t in gguf if "_exps" not in t.name and t.name != GLOBAL_TENSORS["embed"]]
    elements = sum(math.prod(t.shape) for t in dense)
    assert dense_bytes(weights) == 4 * elements  # float32 on the CPU; the embedding table is not read in full
    per_expert = {i: 3 * 256 * 144 for i in weights.moe_layers}  # gate, up, down: 256 rows of one Q4_K block
    split = token_bytes(weights, per_expert, host_layers=[0])
    assert (split.host_experts, split.resident_experts) == (4 * 3 * 256 * 144, 4 * 3 * 256 * 144)


def test_cache_deltas_subtract_and_phases_give_per_token_figures() -> None:
    before, after = CacheDelta(10, 30, 100, 0, 4), CacheDelta(40, 40, 700, 60, 10)
    assert after.minus(before) == CacheDelta(30, 10, 600, 60, 6) and after.minus(before).hit_ratio == 0.75
    assert CacheDelta(0, 0, 0, 0, 0).hit_ratio == 0.0
    runs = [Phase(DECODE, 2, run, 6, seconds, CacheDelta(3, 1, 60 * run, 0, 0)) for run, seconds in
            ((0, 100.0), (1, 0.5), (2, 1.0), (3, 2.0))]
    figures = decode_figures(runs, batch=2)  # the warm-up (run 0) is left out of the medians
    assert figures.tokens_per_second == 6.0 and figures.uploaded_bytes_per_token == 20.0
    assert figures.hit_ratio == 0.75


def test_run_settings_reject_runs_without_decode_steps() -> None:
    with pytest.raises(ValueError, match="gen_len >= 2"):
        RunSettings(prompt_len=8, decode_prompt_len=4, gen_len=1, batches=(1,), repeats=1)
    assert RunSettings(512, 16, 128, (1, 8, 32), 3).context_len == 513
    with pytest.raises(ValueError, match="warmup_gen_len"):
        RunSettings(8, 4, 2, (1,), 1, warmup_gen_len=1)
    assert RunSettings(8, 4, 2, (1,), 1, warmup_gen_len=40).context_len == 44


def test_a_longer_warm_up_decodes_more_tokens_and_fills_a_slowly_promoting_cache(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(ModelConfig(str(tiny_model), "cpu", max_context=64),
                                    CacheConfig(cpu_moe=True, budget_mib=2, policy="decay", promote_per_step=1),
                                    SchedulerConfig(2, 64, 64)))
    try:
        settings = RunSettings(prompt_len=4, decode_prompt_len=4, gen_len=3, batches=(2,), repeats=1,
                               warmup_gen_len=30)
        phases = [p for p in measure(engine, settings, "synthetic:qwen3") if p.kind == DECODE]
        assert [(p.run, p.tokens) for p in phases] == [(0, 2 * 29), (1, 2 * 2)]  # the first token: prompt phase
        assert engine.cache.stats.snapshot().promotions >= 20  # one promotion a step over the warm-up
    finally:
        engine.close()


def test_each_phase_counts_the_expert_picks_of_its_own_steps(tiny_model: Path) -> None:
    """A step's record is processed while the next step runs: a phase's cache figures still hold exactly
    its own steps (the decode phase none of the prompt step that gave the first tokens)."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(tiny_model), "cpu", max_context=64),
                                    CacheConfig(cpu_moe=True, budget_mib=2, policy="lru"), SchedulerConfig(2, 64, 64)))
    try:
        settings = RunSettings(prompt_len=6, decode_prompt_len=4, gen_len=5, batches=(2,), repeats=1)
        phases = measure(engine, settings, "synthetic:qwen3")
        hp = engine.weights.hparams
        picks_per_token = hp.top_k * len(engine.cache.placement.host_layers)
        assert {p.kind for p in phases} == {PREFILL, DECODE_PROMPT, DECODE}
        for p in phases:
            assert p.cache.hits + p.cache.misses == p.tokens * picks_per_token, p
    finally:
        engine.close()


def test_host_ceilings_stand_in_for_the_device_without_an_accelerator() -> None:
    shape = ExpertShape(hidden=256, ff=256, num_experts=16, top_k=4, gate_type=Q4_K, down_type=Q4_K)
    c = measure_ceilings(torch.device("cpu"), shape)
    assert c.zero_copy_gbps == c.cpu_read_gbps and "host" in c.device
    rates = (c.link_gbps, c.hbm_gbps, c.cpu_read_gbps, c.cpu_expert_gbps)
    assert all(math.isfinite(v) and v > 0 for v in rates)


def test_a_budget_that_caches_nothing_is_skipped_and_the_sweep_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "wide.gguf"  # one expert is 1.7 MiB: 4 slots (top-k) need 7 MiB
    preset = with_overrides(PRESETS["tiny"], num_layers=1, num_experts=8, top_k=4, hidden=1024,
                            expert_ff=1024)
    write_synth(path, preset, build_embedded_vocab())
    engine = LLMEngine(EngineConfig(ModelConfig(str(path), "cpu", max_context=32),
                                    CacheConfig(cpu_moe=True, budget_mib=0), SchedulerConfig(2, 32, 32)))
    settings = RunSettings(prompt_len=8, decode_prompt_len=4, gen_len=2, batches=(1,), repeats=1)

    def run(budget_mib: int) -> ConfigResult | Skipped:
        return run_configuration(engine, SweepPoint("lru", "cpu", 0, budget_mib), settings, "synthetic:qwen3",
                                 ceilings())

    try:
        small = run(1)
        assert isinstance(small, Skipped) and "smallest useful budget is 7 MiB" in small.reason
        assert engine.cache.plan.num_slots == 0 and engine.cache.placement.budget_bytes == 0
        enough = run(7)
        assert isinstance(enough, ConfigResult) and enough.num_slots == 4 and enough.applied_budget_mib == 7
    finally:
        engine.close()


def test_each_configuration_replays_the_same_routing(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(ModelConfig(str(tiny_model), "cpu", max_context=32),
                                    CacheConfig(cpu_moe=True, budget_mib=0), SchedulerConfig(2, 32, 32)))
    try:
        streams = []
        for _ in range(2):
            router = make_router("synthetic:qwen3", engine.weights, 32, engine.device)
            engine.set_router(router)
            assert isinstance(router, ReplayRouter)
            streams.append([router.source.next_step(2) for _ in range(5)])  # 5 tokens of 2 streams
        assert all((a == b).all() for a, b in zip(*streams))
        engine.set_router(make_router("model", engine.weights, 32, engine.device))
        assert isinstance(engine.model.router, TopKRouter)
    finally:
        engine.close()


@pytest.mark.gpu
def test_device_ceilings_measure_pcie_zero_copy_hbm_and_host_memory_at_once() -> None:
    shape = ExpertShape(hidden=2048, ff=768, num_experts=128, top_k=8, gate_type=Q4_K, down_type=Q4_K)
    c = measure_ceilings(torch.device("cuda"), shape)
    assert c.zero_copy_gbps is not None and 0 < c.zero_copy_gbps < c.hbm_gbps
    assert 0 < c.link_gbps < c.hbm_gbps and "host" not in c.device
    assert c.at_once_gbps is not None and all(0 < g < c.hbm_gbps for g in c.at_once_gbps)
    bank = pinned_bank(ExpertShape(256, 256, 16, 4, Q4_K, Q4_K), 64 << 20)  # small experts, many of them
    assert bank.gate.is_pinned() and bank.gate[0].numel() * bank.num_experts >= 64 << 20
