"""The expert cache executor on the CPU: every invariant of DESIGN.md, on random routings, budgets,
policies, miss modes and batch sizes, with real GGUF expert bytes and the real copy thread."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.device import CopyEngine, CopyHandle
from engine.expert_cache.executor import ExpertCache, build_expert_cache
from engine.expert_cache.plan import CacheBudgetError
from engine.expert_cache.profile import Profile
from engine.expert_cache.split import MissSplit
from engine.expert_cache.store import ExpertStore
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.moe import ReferenceExperts
from engine.routing import RoutingTrace
from engine.synth import PRESETS, with_overrides, write_synth
from engine.types import Request, SamplingParams
from engine.weights import ModelWeights, expert_bytes, load_weights

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # the native CPU kernel: ~1e-4 (two int8 activation planes); one missing or doubled pair moves ~40%


@pytest.fixture(scope="module")
def weights(small_moe_gguf: Path) -> ModelWeights:
    return load_weights(GGUFFile(small_moe_gguf), CPU, torch.float32)


def make_cache(weights: ModelWeights, **cfg: object) -> ExpertCache:
    return build_expert_cache(ExpertStore(weights, CPU), CacheConfig(**{"cpu_moe": True, **cfg}))


def random_step(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int,
                hot: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, expert ids `[tokens, top_k]` (distinct per token, drawn mostly from a hot set), weights."""
    ids = np.stack([rng.choice(hot if rng.random() < 0.8 else np.arange(num_experts), top_k, replace=False)
                    for _ in range(num_tokens)])
    x = torch.from_numpy(rng.standard_normal((num_tokens, 256)).astype(np.float32))
    w = torch.from_numpy(rng.random((num_tokens, top_k)).astype(np.float32) + 0.1)
    return x, torch.from_numpy(ids).long(), w


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def published_bytes_match(cache: ExpertCache) -> bool:
    """Every published (layer, expert) -> slot holds exactly that expert's bytes."""
    for layer, expert in (cache.table.host >= 0).nonzero().tolist():
        slot = int(cache.table.host[layer, expert])
        pool, host = cache.pools[cache.group_of[layer]], cache.host[layer]
        for part in ("gate", "up", "down"):
            if not torch.equal(getattr(pool, part)[slot], getattr(host, part)[expert]):
                return False
    return True


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["lru", "decay", "lfru"]), mode=st.sampled_from(["cpu", "stream", "hybrid"]),
       budget_mib=st.sampled_from([0, 1, 2, 4]), sizes=st.lists(st.sampled_from([1, 2, 5, 8, 32, 40]),
                                                               min_size=3, max_size=6), seed=st.integers(0, 99))
def test_outputs_equal_reference_and_invariants_hold(weights: ModelWeights, policy: str, mode: str,
                                                     budget_mib: int, sizes: list[int], seed: int) -> None:
    cache = make_cache(weights, policy=policy, miss_mode=mode, budget_mib=budget_mib, promote_per_step=4)
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    hp, rng = weights.hparams, np.random.default_rng(seed)
    hot = rng.choice(hp.num_experts, 6, replace=False)
    assert cache.plan.cache_bytes <= budget_mib << 20  # NOTE: the budget is never exceeded
    for size in sizes:
        if size > 32:
            cache._publish_done(wait=True)
        before = cache.table_residents() if size > 32 else None
        promotions_before = cache.stats.snapshot().promotions
        for layer in weights.moe_layers:
            x, ids, w = random_step(rng, size, hp.num_experts, hp.top_k, hot)
            assert rel_error(cache(layer, x, ids, w), ref(layer, x, ids, w)) < TOLERANCE
        cache.end_step()
        snap = cache.stats.snapshot()
        if before is not None:  # NOTE: a prefill batch never promotes or evicts
            cache._publish_done(wait=True)
            assert snap.promotions == promotions_before and cache.table_residents() == before
        assert published_bytes_match(cache)  # NOTE: published only after the copy completed
    snap = cache.stats.snapshot()
    picks = sum(sizes) * hp.top_k * len(weights.moe_layers)
    assert snap.hits() + snap.misses() == picks  # NOTE: every pair counted exactly once
    assert snap.uploaded_bytes == snap.promotions * expert_bytes(weights.layers[0].ffn.experts)
    cache.close()


def test_every_pair_goes_down_exactly_one_path(weights: ModelWeights) -> None:
    """Hits on the device, misses on the CPU: the CPU path sees exactly the misses."""
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=2)
    rng = np.random.default_rng(0)
    hot = np.arange(8)
    for _ in range(6):  # warm the cache
        for layer in weights.moe_layers:
            cache(layer, *random_step(rng, 4, 16, 4, hot))
        cache.end_step()
    cache._publish_done(wait=True)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = cache.cpu.submit
    cache.cpu.submit = lambda fn, x, tokens, experts, *a, **kw: (seen.append((tokens, experts)),  # type: ignore
                                                                  real(fn, x, tokens, experts, *a, **kw))[1]
    x, ids, w = random_step(rng, 8, 16, 4, hot)
    slots = cache.table.host[weights.moe_layers[0]][ids]
    cache(weights.moe_layers[0], x, ids, w)
    tokens, experts = seen[0]
    missed = (slots < 0).nonzero()
    assert sorted(zip(tokens.tolist(), experts.tolist())) == sorted(
        (t, int(ids[t, k])) for t, k in missed.tolist())
    assert 0 < len(missed) < ids.numel()
    cache.close()


class GatedCopies(CopyEngine):
    """Copies that finish only when the test says so (the slow PCIe of a real machine)."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.gate = threading.Event()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyHandle:
        def run() -> None:
            self.gate.wait()
            for dst, src in pairs:
                dst.copy_(src)
        return CopyHandle(future=self.thread.submit(run))


def test_slots_publish_only_after_their_copy(weights: ModelWeights) -> None:
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)
    cache.copies = GatedCopies()
    layer = weights.moe_layers[0]
    x, ids, w = random_step(np.random.default_rng(1), 2, 16, 4, np.arange(16))
    cache(layer, x, ids, w)
    cache.end_step()
    assert cache.stats.snapshot().promotions > 0
    assert int((cache.table.host >= 0).sum()) == 0  # copies in flight: nothing published yet
    assert int((cache.table.device_table >= 0).sum()) == 0
    again = cache(layer, x, ids, w)  # a step during the copies computes everything as misses
    cache.end_step()
    assert cache.stats.snapshot().hits() == 0
    cache.copies.gate.set()
    cache._publish_done(wait=True)
    assert int((cache.table.host >= 0).sum()) > 0 and published_bytes_match(cache)
    assert rel_error(cache(layer, x, ids, w), again) < TOLERANCE
    cache.close()


def test_a_slot_reassigned_in_flight_is_not_published_for_the_old_expert(weights: ModelWeights) -> None:
    cache = make_cache(weights, policy="lru", miss_mode="cpu", budget_mib=1)  # 9 slots for 4 layers
    cache.copies = GatedCopies()
    rng = np.random.default_rng(2)
    for _ in range(4):  # many promotions while nothing completes: slots get reassigned
        for layer in weights.moe_layers:
            cache(layer, *random_step(rng, 3, 16, 4, np.arange(16)))
        cache.end_step()
    cache.copies.gate.set()
    cache._publish_done(wait=True)
    residents = cache.table_residents()
    assert len(set(residents.values())) == len(residents)  # a slot holds one expert
    assert published_bytes_match(cache)
    cache.close()


def test_budget_that_caches_nothing_is_a_clear_error(tmp_path: Path, vocab: dict) -> None:
    path = tmp_path / "wide.gguf"  # experts of 0.84 MiB, top-4: four slots need 4 MiB
    write_synth(path, with_overrides(PRESETS["tiny"], expert_ff=2048, top_k=4), vocab)
    wide = load_weights(GGUFFile(path), CPU, torch.float32)
    assert expert_bytes(wide.layers[0].ffn.experts) == 3 * 2048 * 144
    with pytest.raises(CacheBudgetError, match=r"smallest useful budget is 4 MiB"):
        make_cache(wide, budget_mib=3)
    make_cache(wide, budget_mib=4).close()
    make_cache(wide, budget_mib=0).close()  # no cache at all is valid: every miss on the CPU


def test_n_cpu_moe_places_the_first_layers_in_host_ram(weights: ModelWeights) -> None:
    cache = make_cache(weights, cpu_moe=False, n_cpu_moe=2, budget_mib=0)
    moe = weights.moe_layers
    assert cache.placement.host_layers == tuple(moe[:2]) and cache.placement.resident_layers == tuple(moe[2:])
    cache.close()


def test_profile_warm_start_and_static_policy(weights: ModelWeights, tmp_path: Path) -> None:
    profile = Profile({layer: {e: 10 - e for e in range(6)} for layer in weights.moe_layers})
    path = tmp_path / "profile.json"
    profile.save(path)
    cache = make_cache(weights, policy="static", budget_mib=2, profile_in=str(path))
    cache._publish_done(wait=True)
    residents = cache.table_residents()
    assert residents and all(expert < 6 for _, expert in residents)
    rng = np.random.default_rng(3)
    for _ in range(3):
        for layer in weights.moe_layers:
            cache(layer, *random_step(rng, 2, 16, 4, np.arange(16)))
        cache.end_step()
    cache._publish_done(wait=True)
    assert cache.table_residents() == residents  # static never changes
    cache.close()


def test_engine_stats_add_up(small_moe_gguf: Path, tmp_path: Path) -> None:
    """The real engine on a Qwen3-MoE GGUF with a small cache: hits + misses = selected experts,
    uploaded bytes = promotions x expert bytes; the profile and trace are written at close."""
    profile, trace = tmp_path / "p.json", tmp_path / "t.npz"
    cfg = EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu", max_context=128),
                       cache=CacheConfig(cpu_moe=True, budget_mib=2, policy="lru", miss_mode="cpu",
                                         profile_out=str(profile), record_trace=str(trace)),
                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine = LLMEngine(cfg)
    for i in range(3):
        engine.add_request(Request(f"r{i}", tuple(engine.tokenizer.encode(f"hello number {i}")),
                                   SamplingParams(max_tokens=6, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    snap = engine.cache.snapshot()
    hp = engine.weights.hparams
    computed = engine.counters["prompt_tokens"] + engine.counters["generation_tokens"] - 3
    assert snap.hits() + snap.misses() == computed * hp.top_k * len(engine.weights.moe_layers)
    assert snap.uploaded_bytes == snap.promotions * expert_bytes(engine.weights.layers[0].ffn.experts)
    assert snap.hits() > 0 and snap.cpu_experts > 0
    engine.close()
    assert profile.exists() and trace.exists()


def test_hybrid_split_sends_the_most_used_experts_to_the_device(weights: ModelWeights) -> None:
    split = MissSplit(stream_share=0.5)
    missed = torch.tensor([3, 3, 3, 7, 7, 1, 9, 9, 9, 9])
    assert split.streamed(missed).tolist() == [3, 9]
    assert MissSplit(0.0).streamed(missed).numel() == 0 and MissSplit(1.0).streamed(missed).tolist() == [1, 3, 7, 9]
    cache = make_cache(weights, miss_mode="cpu", budget_mib=0)
    cache.cfg = CacheConfig(cpu_moe=True, budget_mib=0, miss_mode="hybrid")
    cache.split = split
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    x, ids, w = random_step(np.random.default_rng(4), 6, 16, 4, np.arange(16))
    assert rel_error(cache(weights.moe_layers[0], x, ids, w), ref(weights.moe_layers[0], x, ids, w)) < TOLERANCE
    cache.end_step()
    snap = cache.stats.snapshot()
    unique = ids.unique().numel()
    assert snap.cpu_experts == unique - round(unique / 2) and snap.streamed_bytes == round(unique / 2) * \
        expert_bytes(weights.layers[0].ffn.experts)
    cache.close()


def run_one(path: Path, trace_out: Path, routing: str = "model") -> list[int]:
    cfg = EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=128),
                       cache=CacheConfig(cpu_moe=True, budget_mib=1, record_trace=str(trace_out)),
                       scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32), routing=routing)
    engine = LLMEngine(cfg)
    engine.add_request(Request("a", tuple(engine.tokenizer.encode("a recorded request")),
                               SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    ids = []
    while engine.has_unfinished():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    engine.close()
    return ids


def test_recorded_trace_replays_the_same_routing(small_moe_gguf: Path, tmp_path: Path) -> None:
    first = run_one(small_moe_gguf, tmp_path / "first.npz")
    trace = RoutingTrace.load(tmp_path / "first.npz")
    num_prompt = len(LLMEngine(EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu")))
                     .tokenizer.encode("a recorded request"))
    assert trace.expert_ids.shape == (num_prompt + 7, 4, 4) and trace.layers == (0, 1, 2, 3)
    replayed = run_one(small_moe_gguf, tmp_path / "second.npz", routing=f"trace:{tmp_path / 'first.npz'}")
    assert replayed == first
    assert np.array_equal(RoutingTrace.load(tmp_path / "second.npz").expert_ids, trace.expert_ids)


def test_reconfigure_keeps_weights_and_swaps_the_cache(small_moe_gguf: Path) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(small_moe_gguf), device="cpu", max_context=64),
                                    cache=CacheConfig(cpu_moe=True, budget_mib=0)))
    host_before = engine.store.host(0)
    for cfg in (CacheConfig(cpu_moe=True, budget_mib=2, policy="decay", miss_mode="stream"),
                CacheConfig(n_cpu_moe=2, budget_mib=1, policy="lfru")):
        engine.reconfigure_cache(cfg)
        assert engine.cache.cfg == cfg and engine.model.experts is engine.cache
        engine.add_request(Request("r", (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
        assert engine.cache.snapshot().hits() + engine.cache.snapshot().misses() > 0
    assert engine.store.host(0) is host_before  # one host copy of the experts, shared by every cache
    assert engine.cache.placement.resident_layers == (2, 3)


def test_usage_snapshot_marks_cached_resident_and_recent_experts(weights: ModelWeights) -> None:
    cache = make_cache(weights, cpu_moe=False, n_cpu_moe=2, budget_mib=2)
    x, ids, w = random_step(np.random.default_rng(5), 3, 16, 4, np.arange(16))
    for layer in weights.moe_layers:
        cache(layer, x, ids, w)
    cache.end_step()
    cache._publish_done(wait=True)
    usage, where = cache.usage_snapshot()
    assert usage.shape == (4, 16) and (where[:2] <= 1).all() and (where[2:] == 2).all()
    picked = np.zeros(16)
    np.add.at(picked, ids.flatten().numpy(), 1)
    assert np.allclose(usage, np.tile(picked, (4, 1)))  # every layer, resident ones included
    assert {(layer, expert) for layer, expert in zip(*np.nonzero(where == 1))} == set(cache.table_residents())
    cache.close()
