"""The device side of the expert cache on a real GPU: pinned host experts, the copy stream and its
events, streamed misses staged in VRAM without a host sync, CUDA graphs equal to eager steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.compute import TableCompute
from engine.expert_cache.executor import ExpertCache, build_expert_cache
from engine.expert_cache.store import ExpertStore
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.model import SeqSpan
from engine.moe import ReferenceExperts
from engine.types import Request, SamplingParams
from engine.weights import ModelWeights, load_weights

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def weights(small_moe_gguf: Path) -> ModelWeights:
    return load_weights(GGUFFile(small_moe_gguf), CUDA, torch.bfloat16)


def make_cache(weights: ModelWeights, **cfg: object) -> ExpertCache:
    return build_expert_cache(ExpertStore(weights, CUDA), CacheConfig(**{"cpu_moe": True, **cfg}))


def random_step(rng: np.random.Generator, n: int, experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(n)])
    x = torch.from_numpy(rng.standard_normal((n, 256)).astype(np.float32)).to(CUDA, torch.bfloat16)
    w = torch.from_numpy(rng.random((n, top_k)).astype(np.float32) + 0.1).to(CUDA)
    return x, torch.from_numpy(ids).to(CUDA), w


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float()))


def test_host_experts_are_pinned_and_tables_point_at_them(weights: ModelWeights) -> None:
    cache = make_cache(weights, budget_mib=2, miss_mode="stream")
    assert all(bank.gate.is_pinned() and bank.down.is_pinned() for bank in cache.host.values())
    assert isinstance(cache.compute, TableCompute) and cache.is_graph_safe
    layer = weights.moe_layers[0]
    host = cache.host[layer]
    ptrs = cache.compute.tables[layer].gate_ptrs.cpu()
    assert int(ptrs[3]) == host.gate.data_ptr() + 3 * host.gate.stride(0)
    cache.close()


def test_streamed_misses_are_staged_in_vram_and_cached_experts_read_in_place(weights: ModelWeights) -> None:
    cache = make_cache(weights, budget_mib=2, miss_mode="stream")
    layer = weights.moe_layers[0]
    (staging,) = cache.compute.staging.values()
    assert staging.gate.is_cuda and staging.num_experts == weights.hparams.num_experts
    ptrs = cache.compute.staged[layer].down_ptrs
    assert int(ptrs[5]) == staging.down.data_ptr() + 5 * staging.down.stride(0)
    pool = cache.pools[cache.group_of[layer]]
    cache._set_table([(layer, 5, 0)])  # expert 5 published in slot 0
    for tables in (cache.compute.tables[layer], cache.compute.staged[layer]):
        assert int(tables.down_ptrs[5]) == pool.down.data_ptr()
    cache._set_table([(layer, 5, -1)])
    assert int(ptrs[5]) == staging.down.data_ptr() + 5 * staging.down.stride(0)
    cache.close()
    cpu = make_cache(weights, budget_mib=2, miss_mode="cpu")
    assert not cpu.compute.staged  # the CPU takes the misses: nothing to stage
    cpu.close()


@pytest.mark.parametrize("mode", ["stream", "cpu", "hybrid"])
def test_every_mode_equals_the_reference_while_the_cache_fills(weights: ModelWeights, mode: str) -> None:
    cache = make_cache(weights, budget_mib=2, miss_mode=mode, promote_per_step=4)
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    rng = np.random.default_rng(0)
    for size in (1, 4, 8, 1, 2, 40, 1):
        for layer in weights.moe_layers:
            x, ids, w = random_step(rng, size, 16, 4)
            assert rel_error(cache(layer, x, ids, w), ref(layer, x, ids, w)) < 4e-2  # CPU misses: int8 activations
        cache.end_step()
    snap = cache.snapshot()
    assert snap.hits() > 0 and snap.promotions > 0
    cache.close()


@pytest.mark.parametrize("cpu_moe", [True, False], ids=["host-experts", "resident"])
def test_prefill_batches_equal_the_reference(weights: ModelWeights, cpu_moe: bool) -> None:
    """Batches above max_cached_batch: layers staged whole (cached experts copied from their slots)
    or read resident, then grouped GEMMs in bf16; decode steps in between keep changing the cache."""
    cache = make_cache(weights, cpu_moe=cpu_moe, budget_mib=2, miss_mode="stream", promote_per_step=8)
    assert cache.stager is not None
    ref = ReferenceExperts({i: weights.layers[i].ffn.experts for i in weights.moe_layers})
    rng = np.random.default_rng(3)
    for size in (1, 2, 64, 1, 4, 64, 33):
        for layer in weights.moe_layers:
            x, ids, w = random_step(rng, size, 16, 4)
            assert rel_error(cache(layer, x, ids, w), ref(layer, x, ids, w)) < 2e-2
        cache.end_step()
    if cpu_moe:
        assert cache.table_residents() and len(cache.stager.buffers) == 1 and not cache.stager.ready
    cache.close()


def test_stream_mode_step_makes_no_host_sync(weights: ModelWeights) -> None:
    cache = make_cache(weights, budget_mib=2, miss_mode="stream")
    rng = np.random.default_rng(1)
    steps = [[random_step(rng, 4, 16, 4) for _ in weights.moe_layers] for _ in range(3)]
    torch.cuda.synchronize()
    for step in steps:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for layer, (x, ids, w) in zip(weights.moe_layers, step):
                cache(layer, x, ids, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cache.end_step()  # between steps a sync is fine (one D2H copy of the routing)
    assert cache.snapshot().misses() > 0
    cache.close()


def test_copies_run_on_their_stream_and_publish_after_their_event(weights: ModelWeights) -> None:
    cache = make_cache(weights, budget_mib=4, miss_mode="stream")
    assert cache.copies.stream != torch.cuda.current_stream()
    rng = np.random.default_rng(2)
    for layer in weights.moe_layers:
        cache(layer, *random_step(rng, 8, 16, 4))
    publish = cache._publish_done
    cache._publish_done = lambda wait=False: None  # keep the copies pending to look at them
    cache.end_step()
    pending = list(cache._pending)
    assert pending and all(p.handle.event is not None for p in pending)
    published = cache.table_residents()
    for p in pending:  # NOTE: nothing is published before its event completed
        assert not any((layer, expert) in published for _, layer, expert, _ in p.entries)
    publish(wait=True)
    for (layer, expert), slot in cache.table_residents().items():
        pool, host = cache.pools[cache.group_of[layer]], cache.host[layer]
        assert torch.equal(pool.gate[slot].cpu(), host.gate[expert]) and torch.equal(pool.down[slot].cpu(),
                                                                                       host.down[expert])
    cache.close()


def make_engine(path: Path, graphs: bool, **cache: object) -> LLMEngine:
    cfg = EngineConfig(model=ModelConfig(str(path), device="cuda", max_context=256, cuda_graphs=graphs),
                       cache=CacheConfig(**cache), scheduler=SchedulerConfig(max_num_seqs=4,
                                                                             max_num_batched_tokens=64))
    return LLMEngine(cfg)


def teacher_forced_logits(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill the prompts, then feed the same fixed tokens: logits of every decode step."""
    engine.runner.forward([SeqSpan(i, 0, len(p)) for i, p in enumerate(prompts)], prompts, None)
    engine.cache.end_step()
    out = []
    for t in range(steps):
        spans = [SeqSpan(i, len(p) + t, 1) for i, p in enumerate(prompts)]
        out.append(engine.runner.forward(spans, [[7 + t]] * len(prompts), None).float().cpu())
        engine.cache.end_step()
    return out


@pytest.mark.parametrize("cache", [dict(), dict(cpu_moe=True, budget_mib=2, miss_mode="stream")],
                         ids=["resident", "stream"])
def test_cuda_graph_steps_equal_eager_steps(small_moe_gguf: Path, cache: dict) -> None:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400]]  # 3 sequences: padded to a graph of 4
    graph_engine, eager_engine = make_engine(small_moe_gguf, True, **cache), make_engine(small_moe_gguf, False, **cache)
    graphed = teacher_forced_logits(graph_engine, prompts, 6)
    eager = teacher_forced_logits(eager_engine, prompts, 6)
    assert (4, 256) in graph_engine.runner.graphs and not eager_engine.runner.graphs
    for g, e in zip(graphed, eager):
        assert rel_error(g, e) < 2e-2
    graph_engine.add_request(Request("r", (1, 2, 3), SamplingParams(max_tokens=8, ignore_eos=True)))
    while graph_engine.has_unfinished():
        graph_engine.step()
    assert graph_engine.cache.snapshot().hits() + graph_engine.cache.snapshot().misses() > 0 or not cache
