"""Each cache policy's rule on hand-made steps."""

from __future__ import annotations

import pytest

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import (
    POLICIES,
    DecayPolicy,
    LfruPolicy,
    PolicyConfig,
    Promotion,
    layer_slots,
    make_policy,
)
from engine.expert_cache.profile import Profile


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


# -- lru ---------------------------------------------------------------------------------------------


def test_lru_pool_is_shared_across_layers_and_evicts_least_recent() -> None:
    lru = make_policy("lru", group((3, 40), num_experts=8, top_k=2, num_slots=3), PolicyConfig())
    assert lru.observe({3: [0, 1], 40: []}) == [Promotion(0, 3, 0, None), Promotion(1, 3, 1, None)]
    assert lru.observe({3: [0], 40: [5]}) == [Promotion(2, 40, 5, None)]
    # (3, 1) was used least recently: a layer-40 expert takes its slot.
    assert lru.observe({40: [6]}) == [Promotion(1, 40, 6, (3, 1))]
    assert lru.residents() == {(3, 0): 0, (40, 6): 1, (40, 5): 2}
    assert lru.slot_of(3, 1) is None and lru.slot_of(40, 6) == 1


def test_lru_never_evicts_an_expert_used_in_the_same_step() -> None:
    lru = make_policy("lru", group(num_experts=8, top_k=4, num_slots=2), PolicyConfig())
    first = lru.observe({0: [0, 1, 2, 3]})
    assert len(first) == 2  # at most num_slots insertions
    assert lru.residents() == {(0, 0): 0, (0, 1): 1}
    # (0, 0) hits, so only one slot can take a miss: the one of (0, 1).
    assert lru.observe({0: [0, 4, 5, 6]}) == [Promotion(1, 0, 4, (0, 1))]
    assert lru.slot_of(0, 0) == 0


def test_lru_inserts_the_most_used_misses_first() -> None:
    lru = make_policy("lru", group(num_experts=8, top_k=2, num_slots=1), PolicyConfig())
    assert lru.observe({0: [1, 2, 2, 3]}) == [Promotion(0, 0, 2, None)]  # two tokens both chose 2


def test_lru_warm_start_makes_the_hottest_most_recent() -> None:
    lru = make_policy("lru", group((0, 1), num_experts=8, top_k=1, num_slots=2), PolicyConfig())
    profile = Profile({0: {1: 5, 2: 1}, 1: {3: 9}})
    assert lru.warm_start(profile) == [Promotion(0, 1, 3, None), Promotion(1, 0, 1, None)]
    assert lru.observe({0: [7]}) == [Promotion(1, 0, 7, (0, 1))]  # the colder (0, 1) goes first


# -- decay -------------------------------------------------------------------------------------------


def test_decay_score_decays_per_token_and_adds_one_per_use() -> None:
    decay = DecayPolicy(group(num_experts=4, top_k=1, num_slots=1), PolicyConfig(decay=0.5))
    decay.observe({0: [0]})
    decay.observe({0: [1]})
    assert decay.score(0, 0) == pytest.approx(0.5)
    decay.observe({0: [1, 1, 2]})  # three tokens: x0.5^3, then +2 and +1
    assert decay.score(0, 0) == pytest.approx(0.5 * 0.125)
    assert decay.score(0, 1) == pytest.approx(1 * 0.125 + 2)
    assert decay.score(0, 2) == pytest.approx(1.0)


def test_decay_promotes_only_an_expert_that_outscores_the_weakest_resident() -> None:
    decay = make_policy("decay", group(num_experts=4, top_k=1, num_slots=1), PolicyConfig(decay=0.9))
    assert decay.observe({0: [0]}) == [Promotion(0, 0, 0, None)]  # the empty slot fills first
    for _ in range(4):
        assert decay.observe({0: [0]}) == []
    assert decay.observe({0: [1]}) == []  # 1.0 < 0.9 * 4.1
    assert decay.observe({0: [1, 1, 1, 1]}) != []  # four uses in one step outscore the decayed resident
    assert decay.residents() == {(0, 1): 0}


def test_decay_caps_promotions_per_step_highest_score_first() -> None:
    config = PolicyConfig(promote_per_step=2)
    decay = make_policy("decay", group((0, 1, 2), num_experts=8, top_k=1, num_slots=3), config)
    promotions = decay.observe({0: [1, 2, 3], 1: [5, 5, 6], 2: [7, 7, 7]})
    assert promotions == [Promotion(2, 2, 7, None), Promotion(1, 1, 5, None)]


def test_decay_fills_empty_slots_before_replacing() -> None:
    config = PolicyConfig(promote_per_step=1)
    decay = make_policy("decay", group((0, 1), num_experts=8, top_k=1, num_slots=2), config)
    assert decay.observe({0: [1]}) == [Promotion(0, 0, 1, None)]
    # Layer 0's miss would gain more (3 - 0.73), but layer 1 still has an empty slot.
    assert decay.observe({0: [2, 2, 2], 1: [4, 5, 6]}) == [Promotion(1, 1, 4, None)]


def test_per_layer_slots_split_evenly_with_the_remainder_first() -> None:
    assert layer_slots(group((4, 5, 6), num_slots=7)) == {4: range(0, 3), 5: range(3, 5), 6: range(5, 7)}
    decay = make_policy("decay", group((4, 5, 6), num_experts=8, top_k=4, num_slots=7), PolicyConfig())
    decay.observe({4: [0, 1, 2, 3], 5: [0, 1, 2, 3], 6: [0, 1, 2, 3]})
    assert sorted(s for (layer, _), s in decay.residents().items() if layer == 5) == [3, 4]


def test_decay_warm_start_seeds_steady_state_scores_per_layer() -> None:
    decay = DecayPolicy(group((0, 1), num_experts=8, top_k=1, num_slots=2), PolicyConfig(decay=0.9))
    promotions = decay.warm_start(Profile({0: {1: 30, 2: 10}, 1: {3: 4}}))
    assert {(p.layer, p.expert) for p in promotions} == {(0, 1), (1, 3)}
    assert decay.score(0, 1) == pytest.approx(0.75 / (1 - 0.9))  # used by 75% of the tokens
    assert decay.score(1, 3) == pytest.approx(1.0 / (1 - 0.9))


# -- lfru --------------------------------------------------------------------------------------------


def test_lfru_replaces_only_when_clearly_hotter() -> None:
    config = PolicyConfig(lfru_margin=2.0, lfru_halve_every=1000)
    lfru = make_policy("lfru", group(num_experts=4, top_k=1, num_slots=1), config)
    lfru.observe({0: [0]})
    lfru.observe({0: [0]})  # resident count 2
    for _ in range(4):
        assert lfru.observe({0: [1]}) == []  # 4 is not > 2 x 2
    assert lfru.observe({0: [1]}) == [Promotion(0, 0, 1, (0, 0))]


def test_lfru_halves_counts_periodically() -> None:
    lfru = LfruPolicy(group(num_experts=4, top_k=1, num_slots=1), PolicyConfig(lfru_halve_every=2))
    scores = []
    for _ in range(5):
        lfru.observe({0: [0]})
        scores.append(lfru.score(0, 0))
    assert scores == [1, 2, 2, 3, 2.5]


def test_lfru_warm_start_seeds_one_halving_period_of_uses() -> None:
    lfru = LfruPolicy(group(num_experts=4, top_k=2, num_slots=2), PolicyConfig(lfru_halve_every=100))
    lfru.warm_start(Profile({0: {0: 10, 1: 10, 2: 5, 3: 5}}))  # 15 tokens
    assert lfru.score(0, 0) == pytest.approx(10 / 15 * 100)
    assert set(lfru.residents()) == {(0, 0), (0, 1)}


# -- static ------------------------------------------------------------------------------------------


def test_static_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="static policy needs --cache-profile"):
        make_policy("static", group(), PolicyConfig())


def test_static_caches_the_groups_most_used_experts_and_never_changes() -> None:
    profile = Profile({0: {1: 10, 2: 1}, 1: {3: 7, 4: 5, 5: 2}})
    static = make_policy(
        "static", group((0, 1), num_experts=8, top_k=1, num_slots=3), PolicyConfig(), profile
    )
    assert static.residents() == {}  # filled by warm_start, whose promotions the caller uploads
    assert len(static.warm_start(profile)) == 3
    assert set(static.residents()) == {(0, 1), (1, 3), (1, 4)}
    before = static.residents()
    for _ in range(5):
        assert static.observe({0: [6], 1: [7]}) == []
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


def test_profile_for_another_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="has 4"):
        make_policy("lru", group(num_experts=4), PolicyConfig(), Profile({0: {9: 1}}))


@pytest.mark.parametrize("name", ["lru", "decay", "lfru"])
def test_group_without_slots_never_promotes(name: str) -> None:
    policy = make_policy(name, group(num_slots=0), PolicyConfig())
    assert policy.observe({0: [1]}) == [] and policy.residents() == {}
