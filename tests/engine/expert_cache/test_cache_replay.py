"""Replaying routing traces through the real policies."""

from __future__ import annotations

import numpy as np
import pytest

from engine.expert_cache.plan import CachePlan, GroupPlan
from engine.expert_cache.policy import PolicyConfig, make_policy
from engine.expert_cache.profile import Profile
from engine.expert_cache.replay import DeviceModel, profile_from_trace, replay
from engine.trace import RoutingTrace
from tools.routing import LOCALITY_MODELS, SyntheticSource


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


# -- warming up on the calibrated synthetic routing ----------------------------------------------------------

WARM_LAYERS, WARM_EXPERTS, WARM_K = 24, 128, 8


def new_request_hits(policy: str, share: float, profile: Profile | None, tokens: int = 400) -> np.ndarray:
    """Hit ratio of each token of a new request (`tools.routing`'s qwen3 model, 24 layers) through the device
    model, from a cold cache or one warm-started from `profile`."""
    group = GroupPlan(0, tuple(range(WARM_LAYERS)), WARM_EXPERTS, WARM_K, 1,
                      int(share * WARM_LAYERS * WARM_EXPERTS))
    cache = make_policy(policy, group, PolicyConfig(), profile)
    device = DeviceModel(cache, uploads=cache.warm_start(profile) if profile is not None else [])
    source = SyntheticSource(LOCALITY_MODELS["qwen3"], WARM_LAYERS, WARM_EXPERTS, WARM_K, seed=5)
    for key in ("earlier-1", "earlier-2"):  # advance the source past the profile's streams
        source.route([key] * 200)
    ids = np.stack([source.route(["new"])[:, 0] for _ in range(tokens)])  # [tokens, layers, top_k]
    return np.array([device.step({layer: ids[t, layer].tolist() for layer in range(WARM_LAYERS)})[0]
                     for t in range(tokens)]) / (WARM_LAYERS * WARM_K)


def earlier_profile() -> Profile:
    """The uses of two earlier requests of the same model (its routers' popularity, their own hot experts)."""
    source, profile = SyntheticSource(LOCALITY_MODELS["qwen3"], WARM_LAYERS, WARM_EXPERTS, WARM_K, seed=5), Profile()
    for key in ("earlier-1", "earlier-2"):
        for _ in range(200):
            ids = source.route([key])[:, 0]
            for layer in range(WARM_LAYERS):
                profile.add(layer, ids[layer].tolist())
    return profile


@pytest.mark.parametrize("share", [0.25, 0.5])
@pytest.mark.parametrize("policy", ["lru", "decay", "lfru"])
def test_policies_reach_their_steady_state_within_64_tokens_and_a_profile_never_delays_it(policy: str,
                                                                                           share: float) -> None:
    cold = new_request_hits(policy, share, None)
    steady = cold[200:].mean()
    # NOTE: 0.02: windows of one drifting stream differ by about 1% (an lfru seeded with a whole halving period of a
    # profile's uses was 12 points below cold for 64 tokens)
    assert cold[64:128].mean() >= steady - 0.02, f"cold: {cold[64:128].mean():.3f} against {steady:.3f}"
    warm = new_request_hits(policy, share, earlier_profile())
    # a profile of other requests starts closer to the steady state and is not in the way afterwards
    assert warm[:16].mean() >= cold[:16].mean() - 0.02
    assert warm[16:64].mean() >= cold[16:64].mean() - 0.02, f"{warm[16:64].mean():.3f} < {cold[16:64].mean():.3f}"


def hybrid_hits(share: float, cpu_share: float, upload_cpu: bool, tokens: int = 64) -> tuple[float, float]:
    """(hit ratio, CPU-computed experts a token) of a new request's `tokens` decode steps after its 16-token
    prompt (a cached step, as bench's) and an earlier request, through lru; each layer's misses past the first
    `(1 - cpu_share) x misses + 0.1` (pair order, as `ops.cache_step`) go to the CPU and do not land;
    `upload_cpu`: the policy promotes them by uploads."""
    group = GroupPlan(0, tuple(range(WARM_LAYERS)), WARM_EXPERTS, WARM_K, 1, int(share * WARM_LAYERS * WARM_EXPERTS))
    device = DeviceModel(make_policy("lru", group, PolicyConfig(), None))
    source = SyntheticSource(LOCALITY_MODELS["qwen3"], WARM_LAYERS, WARM_EXPERTS, WARM_K, seed=7)

    def step(ids: np.ndarray) -> tuple[int, int]:  # ids [layers, tokens, top_k] -> (hits, CPU experts)
        used = {layer: ids[layer].reshape(-1).tolist() for layer in range(WARM_LAYERS)}
        device.prepare(used)  # the tables the step's kernels see
        on_cpu = set()
        for layer, layer_ids in used.items():
            missed = [e for e in dict.fromkeys(layer_ids) if (layer, e) not in device.published]
            streamed = min(int((1 - cpu_share) * len(missed) + 0.1 + 0.5), len(missed))
            on_cpu |= {(layer, e) for e in missed[streamed:]}
        return device.step(used, frozenset(on_cpu), upload_cpu)[0], len(on_cpu)

    for _ in range(200):
        step(source.route(["earlier"]))
    source.release("earlier")
    step(source.route(["new"] * 16))
    hits, computed = np.sum([step(source.route(["new"])) for _ in range(tokens)], axis=0)
    return hits / (tokens * WARM_LAYERS * WARM_K), computed / tokens


def test_hybrid_cpu_misses_cost_hits_where_the_working_set_fits_and_uploads_win_them_back() -> None:
    """Why hybrid uploads what the CPU computed only at large budgets (`Split.uploads_cpu_misses`): a CPU-computed
    expert does not land, so its next use misses again. Where the cache holds the request's working set (50%)
    each costs about one later miss; where the cache churns anyway (25%) a fraction of one. Uploading them wins
    the hits back."""
    cost = {}
    for share in (0.5, 0.25):
        stream, _ = hybrid_hits(share, 0.0, False)
        hybrid, cpu_experts = hybrid_hits(share, 0.58, False)
        cost[share] = (stream - hybrid) * WARM_LAYERS * WARM_K / cpu_experts  # later misses per CPU expert
        if share == 0.5:
            uploaded, _ = hybrid_hits(share, 0.58, True)
            assert uploaded >= stream - 0.005 > hybrid, (uploaded, stream, hybrid)
    assert cost[0.5] > 0.7 and cost[0.25] < 0.4 and cost[0.5] > 2 * cost[0.25], cost
