"""Replaying routing traces through the real policies."""

from __future__ import annotations

import numpy as np
import pytest

from engine.expert_cache.plan import CachePlan, GroupPlan
from engine.expert_cache.policy import PolicyConfig
from engine.expert_cache.profile import Profile
from engine.expert_cache.replay import profile_from_trace, replay
from engine.trace import RoutingTrace


def trace_of(
    tokens: list[list[list[int]]], num_experts: int = 8, layers: tuple[int, ...] = ()
) -> RoutingTrace:
    """`tokens [num_tokens][num_layers][top_k]`."""
    return RoutingTrace(np.array(tokens), num_experts, "test", layers)


def one_group(num_slots: int, layers: tuple[int, ...] = (0,), top_k: int = 1) -> CachePlan:
    return CachePlan((GroupPlan(0, layers, 8, top_k, 1, num_slots),), budget_bytes=num_slots)


def test_lru_replay_counts_hits_before_each_step_and_applies_decisions_a_step_late() -> None:
    trace = trace_of([[[0]], [[0]], [[1]], [[0]], [[2]], [[1]]])
    # 0 lands, hit 0, 1 lands (the host evicts 0 to keep a slot offered), 0 still hits (the eviction applies
    # after the next step), 2 lands in 0's slot (the host evicts 1), 1 still hits
    result = replay(trace, one_group(2), "lru", PolicyConfig())
    assert result.hit_ratio == pytest.approx(3 / 6)
    assert result.per_group == {0: pytest.approx(3 / 6)}
    assert result.promotions == 3
    uploads = replay(trace, one_group(2), "lru", PolicyConfig(), landing=False)  # cpu: misses uploaded
    # uploaded 0, 1, 2; a copy publishes after the next step, so 0 misses at t1 and 1 still hits at t5
    assert uploads.hit_ratio == pytest.approx(2 / 6) and uploads.promotions == 3


def test_uncached_groups_miss_and_layers_outside_the_plan_do_not_count() -> None:
    plan = CachePlan((GroupPlan(0, (0,), 8, 1, 1, 1), GroupPlan(1, (1,), 8, 1, 1, 0)), budget_bytes=1)
    trace = trace_of([[[3], [4], [5]]] * 4)  # layer 2 is resident on the GPU: not in the plan
    result = replay(trace, plan, "lru", PolicyConfig())
    assert result.per_group == {0: 0.75, 1: 0.0}
    assert result.hit_ratio == pytest.approx(3 / 8)


def test_trace_layers_name_model_layers() -> None:
    trace = trace_of([[[3]], [[3]]], layers=(5,))
    assert replay(trace, one_group(1, layers=(5,)), "lru", PolicyConfig()).hit_ratio == 0.5
    assert replay(trace, one_group(1, layers=(0,)), "lru", PolicyConfig()).per_group == {}


def test_warm_start_from_a_profile_hits_from_the_first_token() -> None:
    trace = trace_of([[[1]], [[2]], [[1]], [[2]]])
    profile = Profile({0: {1: 10, 2: 10}})
    assert replay(trace, one_group(2), "decay", PolicyConfig(), profile).hit_ratio == 1.0
    assert replay(trace, one_group(2), "decay", PolicyConfig()).hit_ratio == 0.5


def test_static_replay_caches_the_profiles_top_experts() -> None:
    trace = trace_of([[[1]], [[1]], [[2]], [[3]], [[1]], [[2]]])
    profile = profile_from_trace(trace)
    assert profile.layer_counts(0) == {1: 3, 2: 2, 3: 1}
    result = replay(trace, one_group(2), "static", PolicyConfig(), profile)
    assert result.hit_ratio == pytest.approx(5 / 6) and result.promotions == 0


def test_static_replay_without_a_profile_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs --cache-profile"):
        replay(trace_of([[[1]]]), one_group(1), "static", PolicyConfig())


def test_trace_of_another_shape_is_rejected() -> None:
    plan = CachePlan((GroupPlan(0, (0,), 8, 2, 1, 2),), budget_bytes=2)
    with pytest.raises(ValueError, match="top-1"):
        replay(trace_of([[[1]]]), plan, "lru", PolicyConfig())
