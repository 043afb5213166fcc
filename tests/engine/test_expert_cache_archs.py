"""The expert cache on each architecture's own layout (DeepSeek: shared experts beside the routed ones, a
leading dense layer, grouped sigmoid routing; gpt-oss: MXFP4 experts with biases by expert id, its clamped
SwiGLU, a router bias; Gemma 4: GELU experts whose gate and up are views of merged tensors, a per-expert
scale, a dense MLP beside them): every (token, expert) pair computed exactly once and the
outputs those of the reference, in every miss mode and policy, at the dispatcher and through the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.profile import Profile
from engine.expert_cache.record import HIT, LANDED, ON_CPU, STAGED
from engine.gguf.reader import GGUFFile
from engine.llm_engine import LLMEngine
from engine.weights import ModelWeights, MoE, load_weights
from ops.cpu_experts import load_native
from tests.engine.reference_experts import ReferenceExperts
from tests.engine.test_expert_cache import TOLERANCE, make_cache, published_bytes_match, random_step, rel_error, step
from tests.engine_runs import teacher_forced

ARCH_PRESETS = ["deepseek2-tiny", "gpt-oss-tiny", "gemma4-tiny"]
POLICIES = ["lru", "decay", "lfru", "static"]
MODES = ["cpu", "stream", "hybrid"]


@pytest.fixture(scope="module", params=ARCH_PRESETS)
def arch_gguf(request: pytest.FixtureRequest, preset_gguf: Callable[[str], Path]) -> Path:
    return preset_gguf(request.param)


@pytest.fixture(scope="module")
def arch_weights(arch_gguf: Path) -> ModelWeights:
    return load_weights(GGUFFile(arch_gguf), torch.device("cpu"), torch.float32)


def warm_profile(weights: ModelWeights, tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    Profile({layer: {e: 10 - e for e in range(6)} for layer in weights.moe_layers}).save(path)
    return str(path)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_pairs_are_computed_once_and_outputs_equal_the_reference(arch_weights: ModelWeights, tmp_path: Path,
                                                                 policy: str, mode: str) -> None:
    profile = warm_profile(arch_weights, tmp_path) if policy == "static" else None
    cache = make_cache(arch_weights, policy=policy, miss_mode=mode, budget_mib=1, promote_per_step=4,
                       profile_in=profile)
    layers = arch_weights.moe_layers
    ref = ReferenceExperts({i: ffn.experts for i in layers if isinstance(ffn := arch_weights.layers[i].ffn, MoE)})
    hp, rng = arch_weights.hparams, np.random.default_rng(len(policy) + len(mode))
    hot = rng.choice(hp.num_experts, 6, replace=False)
    picks = 0
    for size in (1, 3, 40, 2, 1, 1):  # decode steps around a prefill batch
        if size > 32:
            cache.flush()
        routed = {layer: random_step(rng, size, hp.num_experts, hp.top_k, hot) for layer in layers}
        outs, record = step(cache, routed, size)
        for layer, (x, ids, w) in routed.items():
            assert rel_error(outs[layer], ref(layer, x, ids, w)) < TOLERANCE
        assert set(np.unique(record.outcome)) <= {HIT, STAGED, LANDED, ON_CPU}  # NOTE: one outcome per pair
        assert published_bytes_match(cache)
        picks += size * hp.top_k * len(layers)
    cache.flush()
    snap = cache.stats.snapshot()
    assert snap.hits() + snap.misses() == picks  # NOTE: every pair counted exactly once
    cache.close()


@pytest.mark.parametrize("mode", ["cpu", "hybrid"])
def test_cpu_pairs_run_as_native_tasks(arch_weights: ModelWeights, mode: str) -> None:
    """The native kernel computes each layout's experts, gpt-oss's MXFP4 with biases and clamped SwiGLU among
    them: the CPU's share of a step is native code the device rings for, never Python."""
    if load_native() is None:
        pytest.skip("no C compiler")
    cache = make_cache(arch_weights, miss_mode=mode, budget_mib=1)
    assert cache.cpu is not None and cache.cpu.is_native  # gemma4's merged gate/up views among them
    hp, rng = arch_weights.hparams, np.random.default_rng(7)
    routed = {layer: random_step(rng, 3, hp.num_experts, hp.top_k, np.arange(hp.num_experts))
              for layer in arch_weights.moe_layers}
    step(cache, routed, 3)
    assert cache.cpu.work().calls > 0
    cache.close()


def engine_logprobs(path: Path, cache: CacheConfig) -> tuple[torch.Tensor, int]:
    """Teacher-forced log-probabilities and the pairs the cache served (hits + misses)."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=64), cache,
                                    SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)))
    ids = engine.tokenizer.encode("The cache computes every expert a token selects exactly once.")
    rows = teacher_forced(engine, ids, 6)
    engine.cache.flush()
    snap = engine.cache.snapshot()
    engine.close()
    return rows, snap.hits() + snap.misses()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_engine_outputs_equal_the_resident_model(arch_gguf: Path, arch_weights: ModelWeights, tmp_path: Path,
                                                 policy: str, mode: str) -> None:
    profile = warm_profile(arch_weights, tmp_path) if policy == "static" else None
    resident, _ = engine_logprobs(arch_gguf, CacheConfig())
    cached, served = engine_logprobs(arch_gguf, CacheConfig(cpu_moe=True, budget_mib=1, policy=policy,
                                                            miss_mode=mode, profile_in=profile))
    assert served > 0
    assert torch.equal(resident.argmax(-1), cached.argmax(-1))
    assert float((resident - cached).abs().max()) < 1e-3  # nats: sums in another order only
