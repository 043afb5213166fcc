"""Invariants every policy keeps on random routings, slot counts, configs and step sequences, driven through
the device model of the cache protocol (`replay.DeviceModel`), with misses landing or uploaded."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import POLICIES, CachePolicy, Decision, PolicyConfig, ScoredPolicy, make_policy
from engine.expert_cache.profile import Profile
from engine.expert_cache.replay import DeviceModel

Step = dict[int, list[int]]


@dataclass(frozen=True)
class Case:
    name: str
    group: GroupPlan
    config: PolicyConfig
    profile: Profile | None
    steps: list[Step]
    landing: bool
    lag: int
    on_cpu: list[frozenset[tuple[int, int]]]  # where misses land: those the CPU computes (hybrid)


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
        free_slots=draw(st.integers(0, 3)),
    )
    token = st.lists(st.integers(0, num_experts - 1), min_size=top_k, max_size=top_k, unique=True)

    def step(num_tokens: int) -> Step:
        return {layer: [e for _ in range(num_tokens) for e in draw(token)] for layer in layers}

    steps = [step(draw(st.integers(1, 4))) for _ in range(draw(st.integers(1, 14)))]
    name = draw(st.sampled_from(POLICIES))
    counts = st.dictionaries(st.integers(0, num_experts - 1), st.integers(0, 50), max_size=num_experts)
    profile: Profile | None = Profile({layer: draw(counts) for layer in layers})
    if name != "static" and draw(st.booleans()):
        profile = None
    landing = draw(st.booleans())
    hybrid = landing and draw(st.booleans())
    on_cpu = [frozenset((layer, e) for layer, ids in s.items() for e in ids if hybrid and draw(st.booleans()))
              for s in steps]
    return Case(name, GroupPlan(0, layers, num_experts, top_k, 1, num_slots), config, profile, steps,
                landing, draw(st.integers(0, 2)), on_cpu)


def check_state(policy: CachePolicy, device: DeviceModel) -> None:
    residents, group = policy.residents(), policy.group
    # NOTE: a slot holds at most one expert and an expert at most one slot.
    assert len(set(residents.values())) == len(residents) <= group.num_slots
    assert all(0 <= slot < group.num_slots for slot in residents.values())
    assert all(policy.slot_of(layer, e) == slot for (layer, e), slot in residents.items())
    for ring, r in enumerate(policy.rings):
        offered = policy.offered(ring)
        # NOTE: an offered slot holds no expert, and belongs to its ring
        assert offered <= set(r.slots) and not offered & set(residents.values())
        assert all(policy.ring_of(layer) == ring for layer in r.layers)
    for (layer, _), slot in residents.items():
        assert slot in policy.rings[policy.ring_of(layer)].slots
    # NOTE: the device publishes an expert only in a slot that holds its bytes (evictions apply before
    # the uploads or landings that reuse the slot)
    assert all(device.content.get(slot) == expert for expert, slot in device.published.items())


def check_decision(policy: CachePolicy, case: Case, before: dict, decision: Decision, step: Step,
                   landed: dict, on_cpu: frozenset[tuple[int, int]]) -> None:
    after = policy.residents()
    evicted = {expert for expert, _ in decision.evictions}
    uploaded = {(p.layer, p.expert) for p in decision.uploads}
    assert all(expert in before or expert in landed for expert in evicted)
    assert not evicted & set(after)
    if case.landing:
        # NOTE: only the CPU's misses are uploaded (hybrid): a streamed miss lands or crosses no more
        assert uploaded <= on_cpu - set(before) and not uploaded & set(landed)
        assert set(after) == (set(before) | set(landed) | uploaded) - evicted
        if isinstance(policy, ScoredPolicy):
            assert len(decision.uploads) <= case.config.promote_per_step
    else:
        assert landed == {} and decision.offers == []
        for p in decision.uploads:
            assert (p.layer, p.expert) not in before and p.expert in step[p.layer]  # only this step's misses
    if case.name == "lru":
        used = {(layer, e) for layer, ids in step.items() for e in ids}
        assert not (evicted - set(landed)) & used  # an expert used in the step is not evicted for it
    elif case.name == "static":
        assert not decision
    elif not case.landing:
        assert len(decision.uploads) <= case.config.promote_per_step
    if isinstance(policy, ScoredPolicy) and case.landing:
        margin = case.config.lfru_margin if case.name == "lfru" else 1.0
        for (layer, e) in evicted - set(landed):
            for kept in set(landed) - evicted:  # a landed expert kept over a resident must beat it
                if kept[0] == layer:
                    assert policy.score(*kept) > margin * policy.score(layer, e) or \
                        policy.score(*kept) >= policy.score(layer, e)


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_policy_invariants(case: Case) -> None:
    policy = make_policy(case.name, case.group, case.config, case.profile, case.landing)
    warm = policy.warm_start(case.profile) if case.profile is not None else []
    if case.name == "static":
        assert case.profile is not None
        assert set(policy.residents()) == set(case.profile.top(case.group.layers, case.group.num_slots))
    device = DeviceModel(policy, lag=case.lag, uploads=warm)
    check_state(policy, device)
    for step, on_cpu in zip(case.steps, case.on_cpu, strict=True):
        reserved = device.prepare(step)  # a larger step's offers: evictions of held experts, never uploads
        check_state(policy, device)
        assert not reserved.uploads and (case.landing or not reserved)
        assert {e for e, _ in reserved.evictions}.isdisjoint(policy.residents())
        before = policy.residents()
        _, landed, decision = device.step(step, on_cpu)
        check_state(policy, device)
        check_decision(policy, case, before, decision, step, landed, on_cpu)
