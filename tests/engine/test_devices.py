"""A model split across two devices, each layer range with its own weights, KV cache and expert cache: on the CPU
with two fake devices (`devices=("cpu", "cpu")`: the CPU named twice, the split's whole code path), and on two GPUs
where the machine has them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.cache import ExpertCache, build_expert_cache
from engine.expert_cache.pipeline import PipelineDispatcher
from engine.expert_cache.plan import MiB
from engine.expert_cache.record import HIT, LANDED, ON_CPU, STAGED
from engine.expert_cache.store import ExpertStore
from engine.gguf.reader import GGUFFile
from engine.layer_split import LayerSplit
from engine.llm_engine import LLMEngine
from engine.weights import ModelWeights, load_weights
from tests.engine.reference_experts import ReferenceExperts
from tests.engine.test_expert_cache import MAX_TOKENS, TOLERANCE, random_step, rel_error, step
from tests.engine_runs import greedy, teacher_forced

CPU = torch.device("cpu")
TWO_CPUS = LayerSplit(("cpu", "cpu"), (0, 2), 4)  # the small model's four MoE layers, two a device
PROMPT = "The expert cache keeps the hot experts of every layer on the device"


def make_engine(path: Path, cache: CacheConfig, **model: str) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(str(path), max_context=128, **model), cache,
                                  SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)))


def greedy_text(engine: LLMEngine, prompt: str, max_tokens: int = 12) -> list[int]:
    return greedy(engine, engine.tokenizer.encode(prompt), max_tokens)


CACHES = {
    "resident": CacheConfig(),
    "cpu-misses-no-cache": CacheConfig(cpu_moe=True, budget_mib=0),
    "cpu-misses-cached": CacheConfig(cpu_moe=True, budget_mib=2, policy="lru"),
    "streamed-misses-cached": CacheConfig(cpu_moe=True, budget_mib=2, miss_mode="stream"),
    "first-layers-in-ram": CacheConfig(n_cpu_moe=3, budget_mib=1, miss_mode="hybrid"),
}


@pytest.mark.parametrize("tensor_split", [None, "3,1"])
@pytest.mark.parametrize("name", list(CACHES))
def test_two_devices_give_the_outputs_of_one(small_moe_gguf: Path, name: str, tensor_split: str | None) -> None:
    """Greedy tokens identical, teacher-forced log-probabilities equal where no cache is involved, else within kernel
    rounding (each device's cache holds other experts than the one device's, and a hit and a miss are computed by
    different kernels)."""
    one = make_engine(small_moe_gguf, CACHES[name], device="cpu")
    two = make_engine(small_moe_gguf, CACHES[name], devices="cpu,cpu", tensor_split=tensor_split)
    assert two.split is not None and len(two.cache.managers) == 2 and two.cache.plan.budget_bytes == \
        one.cache.plan.budget_bytes
    assert greedy_text(two, PROMPT) == greedy_text(one, PROMPT)
    ids = one.tokenizer.encode(PROMPT + " and the rest on the host")
    expected, got = teacher_forced(one, ids, 6), teacher_forced(two, ids, 6)
    tolerance = 0.0 if CACHES[name].budget_mib in (None, 0) else 1e-4  # log-probabilities spread ~0.3 here
    assert torch.allclose(got, expected, atol=tolerance, rtol=0), float((got - expected).abs().max())
    one.close()
    two.close()


def test_each_device_holds_its_layers_kv_cache_and_expert_cache(small_moe_gguf: Path) -> None:
    engine = make_engine(small_moe_gguf, CacheConfig(cpu_moe=True, budget_mib=2), devices="cpu,cpu",
                         tensor_split="3,1")
    split, cache = engine.split, engine.cache
    assert split is not None and split.ranges == (range(0, 3), range(3, 4))
    assert engine.model.handoffs == {3: CPU}  # the step goes on to the second device at its first layer
    assert len(engine.kv.storage) == 4  # each device's K and V: one tensor each
    assert all(engine.kv.k[i].untyped_storage().data_ptr() == engine.kv.storage[0].untyped_storage().data_ptr()
               for i in range(3))
    assert engine.kv.k[3].untyped_storage().data_ptr() == engine.kv.storage[2].untyped_storage().data_ptr()
    assert isinstance(cache.dispatcher, PipelineDispatcher) and not cache.dispatcher.is_graph_safe
    first, second = cache.managers
    assert sorted(first.host) == [0, 1, 2] and sorted(second.host) == [3]  # each manager its own layers
    assert first.copies is not second.copies and not set(map(id, first.pools.values())) & set(
        map(id, second.pools.values()))
    assert not {g.group_id for g in first.plan.groups} & {g.group_id for g in second.plan.groups}
    # NOTE: the budget is split in proportion to the layers' host expert bytes (3:1 here) and never exceeded
    budgets = [m.plan.budget_bytes for m in cache.managers]
    assert sum(budgets) == 2 * MiB and budgets[0] == 3 * budgets[1]
    assert all(m.plan.cache_bytes <= m.plan.budget_bytes for m in cache.managers)
    assert [d.device for d in cache.snapshot().devices] == ["cpu#0", "cpu#1"]
    engine.close()


def test_n_cpu_moe_counts_the_models_first_layers_on_every_device(small_moe_gguf: Path) -> None:
    engine = make_engine(small_moe_gguf, CacheConfig(n_cpu_moe=3, budget_mib=1), devices="cpu,cpu")
    first, second = engine.cache.managers
    assert sorted(first.host) == [0, 1] and sorted(second.host) == [2]
    assert engine.cache.placement.host_layers == (0, 1, 2) and engine.cache.placement.resident_layers == (3,)
    assert sorted(engine.cache.dispatcher.resident) == [3]
    engine.close()


@pytest.fixture(scope="module")
def weights(small_moe_gguf: Path) -> ModelWeights:
    return load_weights(GGUFFile(small_moe_gguf), CPU, torch.float32)


def split_cache(weights: ModelWeights, **cfg: object) -> ExpertCache:
    config = CacheConfig(**{"cpu_moe": True, **cfg})  # type: ignore[arg-type]
    return build_expert_cache(ExpertStore(weights, CPU), config, MAX_TOKENS, weights.moe_layers,
                              weights.hparams.num_layers, layer_split=TWO_CPUS)


def published_bytes_match(cache: ExpertCache) -> bool:
    """Every expert a device's tables publish holds exactly that expert's bytes in that device's slot."""
    for m in cache.managers:
        for layer in m.host:
            row = cache.dispatcher.rows[layer]
            for expert in np.nonzero(m.tables.state[row].numpy() >= 0)[0].tolist():
                slot, pool = int(m.tables.state[row, expert]), m.pools[m.group_of[layer]]
                if not all(torch.equal(getattr(pool, part)[slot], getattr(m.host[layer], part)[expert])
                           for part in ("gate", "up", "down")):
                    return False
    return True


@pytest.mark.parametrize("mode", ["cpu", "stream", "hybrid"])
@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_every_pair_is_computed_exactly_once_with_two_managers(weights: ModelWeights, mode: str, policy: str) -> None:
    cache = split_cache(weights, policy=policy, miss_mode=mode, budget_mib=2, promote_per_step=4)
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    hp, rng = weights.hparams, np.random.default_rng(7)
    hot = rng.choice(hp.num_experts, 6, replace=False)
    picks = 0
    for size in [1, 2, 5, 8, 40, 3, 1, 1]:
        if size > 32:
            cache.flush()
        layers = {layer: random_step(rng, size, hp.num_experts, hp.top_k, hot) for layer in weights.moe_layers}
        outs, record = step(cache, layers, size)
        for layer, (x, ids, w) in layers.items():
            assert rel_error(outs[layer], ref(layer, x, ids, w)) < TOLERANCE  # no pair missing or doubled
        # NOTE: exactly once: every pair of every layer, whichever device holds it, has one outcome
        assert set(np.unique(record.outcome[:, :size * hp.top_k])) <= {HIT, STAGED, LANDED, ON_CPU}
        assert all(np.array_equal(record.ids[cache.dispatcher.rows[layer]].reshape(size, -1), ids.numpy())
                   for layer, (_, ids, _) in layers.items())
        assert published_bytes_match(cache)
        picks += size * hp.top_k * len(weights.moe_layers)
    cache.flush()
    snap = cache.snapshot()
    assert snap.hits() + snap.misses() == picks  # NOTE: every pair counted exactly once
    assert sum(d.hits for d in snap.devices) == snap.hits() and sum(d.misses for d in snap.devices) == snap.misses()
    assert sum(d.cache_bytes for d in snap.devices) == snap.cache_bytes <= 2 * MiB
    assert sum(d.promotions for d in snap.devices) == snap.promotions
    residents = cache.table_residents()
    assert {layer for layer, _ in residents} <= set(weights.moe_layers)
    cache.close()


def test_a_budget_one_device_cannot_use_leaves_it_uncached_with_a_warning(weights: ModelWeights) -> None:
    """A device whose share caches nothing is not cached (a warning naming it); the other device's still is."""
    small = LayerSplit(("cpu", "cpu"), (0, 3), 4)  # 3:1 host bytes: 1 MiB gives the second device too few slots
    cache = build_expert_cache(ExpertStore(weights, CPU), CacheConfig(cpu_moe=True, budget_mib=1), MAX_TOKENS,
                               weights.moe_layers, weights.hparams.num_layers, layer_split=small)
    first, second = cache.managers
    assert first.plan.num_slots > 0 and second.plan.num_slots == 0
    assert any("cpu#1" in w for w in cache.plan.warnings)
    cache.close()


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")


def assert_same_outputs(path: Path, name: str, one: dict[str, str], two: dict[str, str]) -> None:
    """float32 (so that a tie between two tokens is not broken by bf16 rounding): greedy tokens identical,
    teacher-forced log-probabilities within the kernels' float32 rounding."""
    first = make_engine(path, CACHES[name], dtype="float32", **one)
    second = make_engine(path, CACHES[name], dtype="float32", **two)
    assert greedy_text(second, PROMPT) == greedy_text(first, PROMPT)
    ids = first.tokenizer.encode(PROMPT + " and the rest on the host")
    expected, got = teacher_forced(first, ids, 6).cpu(), teacher_forced(second, ids, 6).cpu()
    assert torch.allclose(got, expected, atol=1e-3, rtol=0), float((got - expected).abs().max())
    first.close()
    second.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resident", "cpu-misses-cached", "streamed-misses-cached"])
def test_the_split_on_one_gpu_named_twice_gives_the_outputs_of_one(small_moe_gguf: Path, name: str) -> None:
    """The split's CUDA path (two caches, eager steps, the CPU's tasks after a host sync) on one GPU."""
    assert_same_outputs(small_moe_gguf, name, {"device": "cuda:0"}, {"devices": "cuda:0,cuda:0"})


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("name", ["resident", "cpu-misses-cached", "streamed-misses-cached", "first-layers-in-ram"])
def test_two_gpus_give_the_outputs_of_one(small_moe_gguf: Path, name: str) -> None:
    assert_same_outputs(small_moe_gguf, name, {"device": "cuda:0"}, {"devices": "cuda:0,cuda:1"})


@pytest.mark.gpu
@TWO_GPUS
def test_two_gpus_hold_each_range_on_its_device(small_moe_gguf: Path) -> None:
    engine = make_engine(small_moe_gguf, CacheConfig(cpu_moe=True, budget_mib=2), devices="cuda:0,cuda:1",
                         tensor_split="1,1")
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    w = engine.weights
    assert w.embed.device == gpu0 and w.norm.device == gpu1 and w.output.device == gpu1
    assert [layer.attn_norm.device for layer in w.layers] == [gpu0, gpu0, gpu1, gpu1]
    assert [engine.kv.k[i].device for i in range(4)] == [gpu0, gpu0, gpu1, gpu1]
    first, second = engine.cache.managers
    assert first.tables.state.device == gpu0 and second.tables.state.device == gpu1
    assert all(p.gate.device == gpu0 for p in first.pools.values())
    assert all(p.gate.device == gpu1 for p in second.pools.values())
    assert engine.runner.capture_all() == 0  # NOTE: steps over two GPUs run eagerly
    engine.close()
