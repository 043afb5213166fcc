"""Invariants every policy keeps on random routings, slot counts, configs and step sequences."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import (
    POLICIES,
    CachePolicy,
    PolicyConfig,
    Promotion,
    ScoredPolicy,
    layer_slots,
    make_policy,
)
from engine.expert_cache.profile import Profile

Step = dict[int, list[int]]


@dataclass(frozen=True)
class Case:
    name: str
    group: GroupPlan
    config: PolicyConfig
    profile: Profile | None
    steps: list[Step]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layers = tuple(draw(st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True)))
    num_experts = draw(st.integers(2, 12))
    top_k = draw(st.integers(1, min(3, num_experts)))
    num_slots = draw(st.integers(0, len(layers) * num_experts))
    config = PolicyConfig(
        promote_per_step=draw(st.integers(1, 4)),
        decay=draw(st.floats(0.3, 0.95)),
        lfru_halve_every=draw(st.integers(1, 4)),
        lfru_margin=draw(st.floats(1.0, 3.0)),
    )
    token = st.lists(st.integers(0, num_experts - 1), min_size=top_k, max_size=top_k, unique=True)

    def step(num_tokens: int) -> Step:
        return {layer: [e for _ in range(num_tokens) for e in draw(token)] for layer in layers}

    steps = [step(draw(st.integers(1, 4))) for _ in range(draw(st.integers(1, 12)))]
    name = draw(st.sampled_from(POLICIES))
    counts = st.dictionaries(st.integers(0, num_experts - 1), st.integers(0, 50), max_size=num_experts)
    profile: Profile | None = Profile({layer: draw(counts) for layer in layers})
    if name != "static" and draw(st.booleans()):
        profile = None
    return Case(name, GroupPlan(0, layers, num_experts, top_k, 1, num_slots), config, profile, steps)


def check_state(policy: CachePolicy, group: GroupPlan) -> None:
    residents = policy.residents()
    # NOTE: a slot holds at most one expert and an expert at most one slot.
    assert len(set(residents.values())) == len(residents) <= group.num_slots
    assert all(0 <= slot < group.num_slots for slot in residents.values())
    assert all(policy.slot_of(layer, e) == slot for (layer, e), slot in residents.items())
    if isinstance(policy, ScoredPolicy):
        ranges = layer_slots(group)
        assert all(slot in ranges[layer] for (layer, _), slot in residents.items())


def check_promotions(before: dict, after: dict, promotions: list[Promotion], step: Step | None) -> None:
    """Applying the promotions, in order, to the state before gives the state after."""
    held = {slot: expert for expert, slot in before.items()}
    assert len({p.slot for p in promotions}) == len(promotions)  # one copy per slot per step
    for p in promotions:
        assert held.get(p.slot) == p.evicted
        assert (p.layer, p.expert) not in before
        assert step is None or p.expert in step[p.layer]  # only this step's misses are promoted
        held[p.slot] = (p.layer, p.expert)
    assert {expert: slot for slot, expert in held.items()} == after


def check_rule(policy: CachePolicy, case: Case, promotions: list[Promotion], step: Step) -> None:
    if case.name == "lru":
        used = {(layer, e) for layer, ids in step.items() for e in ids}
        assert len(promotions) <= case.group.num_slots
        assert all(p.evicted not in used for p in promotions)
    elif case.name == "static":
        assert promotions == []
    else:
        assert isinstance(policy, ScoredPolicy)
        assert len(promotions) <= case.config.promote_per_step
        margin = case.config.lfru_margin if case.name == "lfru" else 1.0
        for p in promotions:
            if p.evicted is not None:  # never evict a resident for a colder expert
                assert policy.score(p.layer, p.expert) > margin * policy.score(*p.evicted)


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_policy_invariants(case: Case) -> None:
    policy = make_policy(case.name, case.group, case.config, case.profile)
    if case.profile is not None:
        warm = policy.warm_start(case.profile)
        check_state(policy, case.group)
        check_promotions({}, policy.residents(), warm, None)
    if case.name == "static":
        assert case.profile is not None
        assert set(policy.residents()) == set(case.profile.top(case.group.layers, case.group.num_slots))
    for step in case.steps:
        before = policy.residents()
        promotions = policy.observe(step)
        check_state(policy, case.group)
        check_promotions(before, policy.residents(), promotions, step)
        check_rule(policy, case, promotions, step)
