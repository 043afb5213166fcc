"""Each cache policy's rule on hand-made steps: where misses land in offered slots (stream, hybrid),
driven through the device model of `replay.py`, and where the policy uploads them (cpu)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import (
    POLICIES,
    PROFILE_TOKENS,
    RESERVE,
    DecayPolicy,
    LfruPolicy,
    PolicyConfig,
    Promotion,
    layer_slots,
    make_policy,
)
from engine.expert_cache.profile import Profile
from engine.expert_cache.replay import DeviceModel


def group(
    layers: tuple[int, ...] = (0,), num_experts: int = 8, top_k: int = 1, num_slots: int = 1
) -> GroupPlan:
    return GroupPlan(0, layers, num_experts, top_k, slot_bytes=1, num_slots=num_slots)


def test_policy_names() -> None:
    assert POLICIES == ("lru", "decay", "lfru", "static")
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        make_policy("fifo", group(), PolicyConfig())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="decay"):
        PolicyConfig(decay=1.0)
    with pytest.raises(ValueError, match="lfru_margin"):
        PolicyConfig(lfru_margin=0.5)
    with pytest.raises(ValueError, match="free_slots"):
        PolicyConfig(free_slots=-1)


# -- landing: misses take offered slots ----------------------------------------------------------------


def test_every_slot_is_offered_at_start_and_misses_land_in_offer_order() -> None:
    lru = make_policy("lru", group((3, 40), num_experts=8, top_k=2, num_slots=3), PolicyConfig(free_slots=1))
    device = DeviceModel(lru, lag=0)
    assert list(device.rings[0]) == [0, 1, 2]
    hits, landed, _ = device.step({3: [0, 1], 40: [0, 1]})
    assert hits == 0 and landed == {(3, 0): 0, (3, 1): 1, (40, 0): 2}  # the fourth miss finds no slot
    assert lru.residents() == {(3, 0): 0, (3, 1): 1, (40, 0): 2}


def test_lru_keeps_free_slots_offered_by_evicting_the_least_recent() -> None:
    lru = make_policy("lru", group((3, 40), num_experts=8, top_k=2, num_slots=4), PolicyConfig(free_slots=1))
    device = DeviceModel(lru, lag=0)
    device.step({3: [0, 1], 40: [2]})  # three land; one slot left offered
    _, _, decision = device.step({3: [0], 40: [5]})  # (40, 5) takes the last one: (3, 1) is least recent
    assert decision.evictions == [((3, 1), 1)] and decision.offers == [(0, 1)]
    assert lru.slot_of(3, 1) is None and lru.offered(0) == frozenset({1})
    hits, landed, _ = device.step({3: [1]})
    assert hits == 0 and landed == {(3, 1): 1}


def test_lru_never_evicts_an_expert_used_in_the_same_step() -> None:
    lru = make_policy("lru", group(num_experts=8, top_k=2, num_slots=3), PolicyConfig(free_slots=2))
    device = DeviceModel(lru, lag=0)
    device.step({0: [0, 1]})
    _, _, decision = device.step({0: [0, 1, 2]})  # the last slot is taken; 0 and 1 were just used
    assert decision.evictions == [] and len(lru.offered(0)) == 0


def test_decay_keeps_a_landed_expert_only_if_it_outscores_the_weakest() -> None:
    config = PolicyConfig(free_slots=1, decay=0.9)
    decay = make_policy("decay", group((0,), num_experts=8, top_k=1, num_slots=3), config)
    device = DeviceModel(decay, lag=0)
    for _ in range(3):
        device.step({0: [1]})  # expert 1: score 2.71
    device.step({0: [2]})  # 2 lands (score 1): the last slot stays offered
    assert set(decay.residents()) == {(0, 1), (0, 2)}
    _, landed, decision = device.step({0: [3]})  # 3 (score 1) lands; 2 has decayed to 0.9 (1: 2.2): 2 goes
    assert landed == {(0, 3): 2} and decision.evictions == [((0, 2), 1)] and decision.offers == [(0, 1)]
    assert set(decay.residents()) == {(0, 1), (0, 3)}


def test_lfru_gives_back_a_landed_expert_that_is_not_clearly_hotter() -> None:
    config = PolicyConfig(free_slots=1, lfru_margin=2.0, lfru_halve_every=1000)
    lfru = make_policy("lfru", group((0,), num_experts=4, top_k=1, num_slots=2), config)
    device = DeviceModel(lfru, lag=0)
    for _ in range(3):
        device.step({0: [0]})  # expert 0: count 3, one slot offered
    _, landed, decision = device.step({0: [1]})  # 1 (count 1) lands, is not > 2 x 3: its slot is given back
    assert decision.evictions == [((0, 1), landed[(0, 1)])]
    assert set(lfru.residents()) == {(0, 0)}


def test_lfru_splits_slots_per_layer_and_lands_per_layer() -> None:
    assert layer_slots(group((4, 5, 6), num_slots=7)) == {4: range(0, 3), 5: range(3, 5), 6: range(5, 7)}
    lfru = make_policy("lfru", group((4, 5, 6), num_experts=8, top_k=4, num_slots=14), PolicyConfig(lfru_margin=1.0))
    device = DeviceModel(lfru, lag=0)
    _, landed, decision = device.step({4: [0, 1, 2, 3], 5: [0, 1, 2, 3], 6: [0, 1, 2, 3]})
    assert sorted(landed[(5, e)] for e in range(4) if (5, e) in landed) == [5, 6, 7, 8]  # layer 5: slots 5..9
    # each ring keeps one slot offered (a quarter of 4 or 5 slots): its weakest landed expert is given back
    assert all(len(lfru.offered(ring)) == 1 for ring in range(3))
    assert all(slot in layer_slots(lfru.group)[layer] for (layer, _), slot in lfru.residents().items())


def test_decay_shares_one_pool_so_a_layer_that_routes_widely_holds_more_slots() -> None:
    """Layer 0 uses the same two experts every token, layer 1 cycles over eight: with one pool of eight slots,
    layer 1 ends up holding most of them (per-layer pools would give each four)."""
    decay = make_policy("decay", group((0, 1), num_experts=16, top_k=2, num_slots=8), PolicyConfig())
    device = DeviceModel(decay, lag=1)
    for t in range(64):
        device.step({0: [0, 1], 1: [2 * (t % 4), 2 * (t % 4) + 1]})
    held = Counter(layer for layer, _ in decay.residents())
    assert held[0] == 2 and held[1] >= 4, held
    assert len(decay.rings) == 1


def test_a_cold_cache_fills_in_one_step_where_misses_land() -> None:
    decay = make_policy("decay", group((0, 1), num_experts=16, top_k=4, num_slots=16), PolicyConfig())
    device = DeviceModel(decay, lag=1)
    device.step({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    assert len(decay.residents()) == 8  # no promote-per-step cap: the copies were the step's own


def test_a_prompt_step_gets_offers_for_its_misses_before_it_runs() -> None:
    """A step of more tokens than the last ones (a new request's prompt) misses far more than the steady
    steps the offers were sized by: `reserve` offers RESERVE x recent misses per token x its tokens,
    evicting the least recent experts but none of the last step's, so the prompt's misses land."""
    lru = make_policy("lru", group((0,), num_experts=64, top_k=2, num_slots=32), PolicyConfig())
    device = DeviceModel(lru, lag=1)
    for t in range(40):  # steady: one new expert a token among a hot set that fills the cache
        device.step({0: [t % 30, 30 + t % 2]})
    offered = len(lru.offered(0))
    assert 0 < offered <= 2
    last = {(0, t % 30) for t in (38, 39)} | {(0, 30), (0, 31)}
    decision = lru.reserve(4)  # 4 tokens (the engine applies it before the step, as here)
    device.apply(decision)
    per_token = lru._token_misses[0]
    assert len(lru.offered(0)) == min(int(RESERVE * per_token * 4 + 0.9), 32 // 4) > offered
    assert {e for e, _ in decision.evictions}.isdisjoint(last)
    assert lru.reserve(1).offers == [] and lru.reserve(4).offers == []  # satisfied: nothing more
    hits, landed, _ = device.step({0: [40, 41, 42, 43, 44, 45, 0, 1]})  # the prompt: 4 tokens, 6 new experts
    assert len(landed) == 6


@pytest.mark.parametrize("name", ["decay", "lfru"])
def test_reserve_offers_per_ring_for_scored_policies(name: str) -> None:
    policy = make_policy(name, group((0, 1), num_experts=32, top_k=2, num_slots=32), PolicyConfig())
    device = DeviceModel(policy, lag=1)
    for t in range(30):
        device.step({0: [t % 20, 20], 1: [t % 20, 21]})
    rings = range(len(policy.rings))  # decay: one pool of 32 slots; lfru: one of 16 a layer
    before = [len(policy.offered(r)) for r in rings]
    policy.reserve(8)
    after = [len(policy.offered(r)) for r in rings]
    assert all(a >= b for a, b in zip(after, before)) and sum(after) > sum(before)
    assert all(a <= 32 // len(rings) // 4 for a in after)  # at most a quarter of each ring


def test_reserve_offers_nothing_where_misses_do_not_land() -> None:
    lru = make_policy("lru", group(num_experts=8, top_k=2, num_slots=4), PolicyConfig(), landing=False)
    for t in range(8):
        lru.observe({0: [t, (t + 1) % 8]})
    assert not lru.reserve(16)


# -- uploads: the cpu miss mode ---------------------------------------------------------------------------


def uploads(policy, step: dict[int, list[int]]) -> list[Promotion]:  # noqa: ANN001
    return policy.observe(step).uploads


def test_lru_uploads_every_miss_over_the_least_recent() -> None:
    lru = make_policy("lru", group((3, 40), num_experts=8, top_k=2, num_slots=3), PolicyConfig(), landing=False)
    assert lru.start().offers == []  # nothing is offered where misses do not land
    assert uploads(lru, {3: [0, 1], 40: []}) == [Promotion(0, 3, 0, None), Promotion(1, 3, 1, None)]
    assert uploads(lru, {3: [0], 40: [5]}) == [Promotion(2, 40, 5, None)]
    decision = lru.observe({40: [6]})  # (3, 1) was used least recently
    assert decision.uploads == [Promotion(1, 40, 6, (3, 1))] and decision.evictions == [((3, 1), 1)]
    assert lru.residents() == {(3, 0): 0, (40, 6): 1, (40, 5): 2}


def test_lru_upload_never_evicts_an_expert_used_in_the_same_step() -> None:
    lru = make_policy("lru", group(num_experts=8, top_k=4, num_slots=2), PolicyConfig(), landing=False)
    assert len(uploads(lru, {0: [0, 1, 2, 3]})) == 2
    assert uploads(lru, {0: [0, 4, 5, 6]}) == [Promotion(1, 0, 4, (0, 1))]
    assert lru.slot_of(0, 0) == 0


def test_decay_uploads_at_most_promote_per_step_best_first() -> None:
    config = PolicyConfig(promote_per_step=2)
    decay = make_policy("decay", group((0, 1, 2), num_experts=8, top_k=1, num_slots=3), config, landing=False)
    # one pool of three slots: the two hottest misses of any layer, into the first free slots
    assert uploads(decay, {0: [1, 2, 3], 1: [5, 5, 6], 2: [7, 7, 7]}) == [Promotion(0, 2, 7, None),
                                                                          Promotion(1, 1, 5, None)]


def test_decay_upload_replaces_only_a_weaker_resident() -> None:
    config = PolicyConfig(promote_per_step=4, decay=0.5)
    decay = make_policy("decay", group(num_experts=8, top_k=1, num_slots=1), config, landing=False)
    uploads(decay, {0: [1, 1, 1]})
    assert uploads(decay, {0: [2]}) == []  # 1 (1.5 after decay) outscores 2 (1)
    assert uploads(decay, {0: [2, 2, 2]})[0].evicted == (0, 1)


def test_decay_warm_start_seeds_steady_state_scores_per_layer() -> None:
    decay = DecayPolicy(group((0, 1), num_experts=8, top_k=1, num_slots=2), PolicyConfig(decay=0.9))
    promotions = decay.warm_start(Profile({0: {1: 30, 2: 10}, 1: {3: 4}}))
    # the pool takes the highest uses per token of either layer: (1, 3) on every token of its layer, not (0, 2)
    assert {(p.layer, p.expert) for p in promotions} == {(0, 1), (1, 3)}
    assert decay.score(0, 1) == pytest.approx(0.75 / (1 - 0.9))  # used by 75% of the tokens
    assert decay.score(1, 3) == pytest.approx(1.0 / (1 - 0.9))


def test_lfru_halves_counts_periodically() -> None:
    lfru = LfruPolicy(group(num_experts=4, top_k=1, num_slots=1), PolicyConfig(lfru_halve_every=2), landing=False)
    scores = []
    for _ in range(5):
        lfru.observe({0: [0]})
        scores.append(lfru.score(0, 0))
    assert scores == [1, 2, 2, 3, 2.5]


def test_lfru_warm_start_seeds_a_few_tokens_of_uses() -> None:
    lfru = LfruPolicy(group(num_experts=4, top_k=2, num_slots=2), PolicyConfig(lfru_halve_every=100))
    lfru.warm_start(Profile({0: {0: 10, 1: 10, 2: 5, 3: 5}}))  # 15 tokens
    assert lfru.score(0, 0) == pytest.approx(10 / 15 * PROFILE_TOKENS)
    assert set(lfru.residents()) == {(0, 0), (0, 1)}


# -- static ------------------------------------------------------------------------------------------


def test_static_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="static policy needs --cache-profile"):
        make_policy("static", group(), PolicyConfig())


@pytest.mark.parametrize("landing", [True, False])
def test_static_caches_the_groups_most_used_experts_and_never_changes(landing: bool) -> None:
    profile = Profile({0: {1: 10, 2: 1}, 1: {3: 7, 4: 5, 5: 2}})
    static = make_policy("static", group((0, 1), num_experts=8, top_k=1, num_slots=3), PolicyConfig(), profile,
                         landing)
    assert static.residents() == {}  # filled by warm_start, whose promotions the caller uploads
    assert len(static.warm_start(profile)) == 3
    assert set(static.residents()) == {(0, 1), (1, 3), (1, 4)}
    assert not static.start()  # nothing offered
    before = static.residents()
    for _ in range(5):
        assert not static.observe({0: [6], 1: [7]})
    assert static.residents() == before
    assert static.warm_start(profile) == []  # already in place


# -- shared checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru", "decay", "lfru"])
def test_policies_reject_foreign_layers_and_ids(name: str) -> None:
    policy = make_policy(name, group((2,), num_experts=4, num_slots=1), PolicyConfig())
    with pytest.raises(ValueError, match="layer 3 is not in group"):
        policy.observe({3: [0]})
    with pytest.raises(ValueError, match="outside"):
        policy.observe({2: [4]})


def test_a_landing_in_a_slot_never_offered_is_refused() -> None:
    policy = make_policy("lru", group(num_slots=2), PolicyConfig())
    with pytest.raises(ValueError, match="not offered"):
        policy.observe({0: [1]}, {(0, 1): 0})


def test_profile_for_another_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="has 4"):
        make_policy("lru", group(num_experts=4), PolicyConfig(), Profile({0: {9: 1}}))


@pytest.mark.parametrize("name", ["lru", "decay", "lfru"])
@pytest.mark.parametrize("landing", [True, False])
def test_group_without_slots_never_promotes(name: str, landing: bool) -> None:
    policy = make_policy(name, group(num_slots=0), PolicyConfig(), landing=landing)
    assert not policy.start() and not policy.observe({0: [1]}) and policy.residents() == {}
