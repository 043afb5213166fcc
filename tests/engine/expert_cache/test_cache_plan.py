"""Cache sizing: grouping, the proportional split, the budget bound and the smallest useful budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.expert_cache.plan import (
    CacheBudgetError,
    CachePlan,
    GroupPlan,
    LayerExperts,
    MiB,
    group_layers,
    plan_cache,
    smallest_useful_budget,
)

Q4 = ("q4_k", (2048, 768))
Q8 = ("q8_0", (2048, 768))
QWEN3_EXPERT = 2_654_208  # bytes of one Qwen3-30B-A3B Q4_K expert (gate + up + down)


def qwen3_layers(num_layers: int = 48, type_key: tuple = Q4, start: int = 0) -> list[LayerExperts]:
    return [LayerExperts(start + i, 128, 8, QWEN3_EXPERT, type_key) for i in range(num_layers)]


def test_layers_with_equal_types_form_one_group_in_layer_order() -> None:
    layers = [*qwen3_layers(2, Q8, start=2), *qwen3_layers(2, Q4), LayerExperts(4, 128, 8, QWEN3_EXPERT, Q4)]
    groups = group_layers(layers)
    assert [[x.layer for x in g] for g in groups] == [[0, 1, 4], [2, 3]]


def test_duplicate_layers_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        group_layers(qwen3_layers(2) + qwen3_layers(1))


def test_group_plan_properties() -> None:
    group = GroupPlan(0, (0, 1), num_experts=4, top_k=2, slot_bytes=10, num_slots=3)
    assert (group.cache_bytes, group.host_bytes, group.share, group.is_cached) == (30, 80, 3 / 8, True)
    assert not GroupPlan(1, (2,), 4, 2, 10, 0).is_cached


def test_single_group_gets_every_slot_the_budget_buys() -> None:
    plan = plan_cache(qwen3_layers(), 1000 * MiB)
    (group,) = plan.groups
    assert group.num_slots == 1000 * MiB // QWEN3_EXPERT
    assert plan.cache_bytes <= plan.budget_bytes and plan.warnings == ()
    assert plan.share == pytest.approx(group.num_slots / (48 * 128))


def test_budget_is_split_in_proportion_to_host_bytes() -> None:
    # 30 layers of one type, 10 of another with the same size: 3:1 split of the budget.
    layers = qwen3_layers(30, Q4) + qwen3_layers(10, Q8, start=30)
    plan = plan_cache(layers, 400 * MiB)
    big, small = plan.groups
    assert big.layers == tuple(range(30)) and small.layers == tuple(range(30, 40))
    assert big.num_slots == 300 * MiB // QWEN3_EXPERT
    assert small.num_slots == 100 * MiB // QWEN3_EXPERT


def test_a_group_never_gets_more_slots_than_experts() -> None:
    small = [LayerExperts(0, 16, 2, 1 * MiB, Q8)]  # 16 MiB of experts
    big = [LayerExperts(i, 128, 8, 1 * MiB, Q4) for i in range(1, 9)]  # 1024 MiB
    assert [g.num_slots for g in plan_cache(small + big, 208 * MiB).groups] == [3, 204]  # 3.2 and 204.8 MiB
    plan = plan_cache(small + big, 4000 * MiB)
    assert [g.num_slots for g in plan.groups] == [16, 1024]
    assert plan.cache_bytes == 1040 * MiB and plan.share == 1.0


def test_group_short_of_top_k_is_not_cached_and_warned_and_its_budget_goes_to_the_others() -> None:
    small = [LayerExperts(0, 64, 8, 1 * MiB, Q8)]  # gets 10% of the budget
    big = [LayerExperts(i, 64, 8, 1 * MiB, Q4) for i in range(1, 10)]
    plan = plan_cache(small + big, 60 * MiB)  # small would get 6 slots < top_k 8
    first, second = plan.groups
    assert first.num_slots == 0 and not first.is_cached
    assert second.num_slots == 60  # the whole budget
    (warning,) = plan.warnings
    assert "group 0" in warning and "top_k 8" in warning
    assert f"{smallest_useful_budget(small + big) // MiB} MiB" in warning


def test_budget_zero_is_no_cache() -> None:
    plan = plan_cache(qwen3_layers(), 0)
    assert plan.num_slots == 0 and plan.cache_bytes == 0 and plan.warnings == ()
    assert not any(g.is_cached for g in plan.groups)


def test_no_host_layers_plans_no_groups() -> None:
    plan = plan_cache([], 100 * MiB)
    assert plan.groups == () and plan.share == 0.0


def test_budget_that_caches_nothing_names_the_smallest_useful_budget() -> None:
    smallest = smallest_useful_budget(qwen3_layers())
    with pytest.raises(CacheBudgetError, match=f"smallest useful budget is {smallest // MiB} MiB") as err:
        plan_cache(qwen3_layers(), 10 * MiB)
    assert err.value.smallest_mib == smallest // MiB


def test_negative_budget_is_rejected() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        plan_cache(qwen3_layers(), -1)


def test_single_group_smallest_budget_caches_exactly_top_k_and_one_mib_less_raises() -> None:
    layers = qwen3_layers()
    smallest = smallest_useful_budget(layers)
    assert smallest % MiB == 0
    assert plan_cache(layers, smallest).groups[0].num_slots == 8
    with pytest.raises(CacheBudgetError):
        plan_cache(layers, smallest - MiB)


def test_plan_rejects_a_cache_over_budget() -> None:
    group = GroupPlan(0, (0,), 8, 2, 10, 4)
    with pytest.raises(ValueError, match="budget"):
        CachePlan((group,), budget_bytes=39)


@st.composite
def layer_sets(draw: st.DrawFn) -> list[LayerExperts]:
    """1-4 groups of 1-6 layers with random shapes and expert sizes (0.1-3 MiB)."""
    layers: list[LayerExperts] = []
    for g in range(draw(st.integers(1, 4))):
        num_experts = draw(st.sampled_from([4, 8, 16, 64, 128]))
        top_k = draw(st.integers(1, min(8, num_experts)))
        expert_bytes = draw(st.integers(MiB // 10, 3 * MiB))
        for _ in range(draw(st.integers(1, 6))):
            layers.append(LayerExperts(len(layers), num_experts, top_k, expert_bytes, ("t", g)))
    return layers


@settings(max_examples=150, deadline=None)
@given(layers=layer_sets(), budget=st.integers(0, 4000 * MiB))
def test_plan_never_exceeds_budget_and_cached_groups_have_top_k(
    layers: list[LayerExperts], budget: int
) -> None:
    try:
        plan = plan_cache(layers, budget)
    except CacheBudgetError:
        assert budget > 0 and budget < smallest_useful_budget(layers)
        return
    assert plan.cache_bytes <= budget
    for group in plan.groups:
        assert group.num_slots == 0 or group.num_slots >= group.top_k
        assert group.num_slots <= group.num_host_experts
    num_uncached = sum(not g.is_cached for g in plan.groups)
    assert len(plan.warnings) == (num_uncached if budget else 0)


@settings(max_examples=100, deadline=None)
@given(layers=layer_sets())
def test_smallest_useful_budget_is_minimal(layers: list[LayerExperts]) -> None:
    smallest = smallest_useful_budget(layers)
    assert smallest % MiB == 0 and smallest > 0
    at = plan_cache(layers, smallest)
    assert all(g.num_slots >= g.top_k for g in at.groups) and at.warnings == ()
    try:
        below = plan_cache(layers, smallest - MiB)
    except CacheBudgetError:
        return
    assert any(b.num_slots < a.num_slots for a, b in zip(at.groups, below.groups, strict=True))
    assert below.warnings or below.budget_bytes == 0  # some group fell short of top_k
