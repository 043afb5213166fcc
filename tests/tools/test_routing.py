"""Routing sources, the replay router, and the synthetic router's calibration to published statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.expert_cache.plan import CachePlan, GroupPlan
from engine.expert_cache.policy import PolicyConfig
from engine.expert_cache.replay import replay
from engine.moe import TopKRouter
from engine.trace import RoutingTrace
from tools.routing import (
    LOCALITY_MODELS,
    ReplayRouter,
    SyntheticSource,
    TraceSource,
    parse_routing,
    routing_locality,
    synthetic_trace,
)

# Qwen3-30B-A3B: cold-LRU hit rate by share of experts cached per layer (tools/routing.py's figures).
QWEN3_LRU_CURVE = {0.06: 0.37, 0.19: 0.74, 0.38: 0.89, 0.64: 0.96}
TOLERANCE = 0.05


def test_locality_of_a_hand_made_trace() -> None:
    ids = [[[0, 1]], [[1, 2]], [[3, 4]], [[0, 5]]]  # one layer, top-2
    loc = routing_locality(RoutingTrace(np.array(ids), 8, "t"), window=2)
    assert loc.prev_overlap.tolist() == [pytest.approx(1 / 6)]  # 1 of 6 picks after the first token
    assert loc.any_prev_overlap.tolist() == [pytest.approx(1 / 3)]
    assert loc.within_window.tolist() == [pytest.approx(1 / 6)]  # expert 0 is back after 3 tokens
    assert loc.median_reuse_distance == np.inf  # 4 of 6 picks are first uses
    assert loc.top_expert_mass.tolist() == [pytest.approx(2 / 8)]


def test_synthetic_traces_are_deterministic_and_distinct_per_token() -> None:
    a = synthetic_trace("qwen3", 3, 128, 8, 100, seed=1)
    b = synthetic_trace("qwen3", 3, 128, 8, 100, seed=1)
    c = synthetic_trace("qwen3", 3, 128, 8, 100, seed=2)
    assert np.array_equal(a.expert_ids, b.expert_ids) and not np.array_equal(a.expert_ids, c.expert_ids)
    ordered = np.sort(a.expert_ids, axis=2)
    assert (np.diff(ordered, axis=2) > 0).all()


@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (16, 1), (64, 6), (256, 8)])
def test_synthetic_router_scales_to_other_shapes(kind: str, num_experts: int, top_k: int) -> None:
    trace = synthetic_trace(kind, 16, num_experts, top_k, 400, seed=0)
    assert trace.expert_ids.shape == (400, 16, top_k) and trace.expert_ids.max() < num_experts
    loc = routing_locality(trace)
    chance = top_k / num_experts  # share of a token's experts the previous token used, at random
    sticky = loc.prev_overlap[4:].mean()
    assert chance < sticky < 0.95  # later layers stick, but never freeze
    assert abs(loc.prev_overlap[0] - chance) < sticky - chance  # layer 0 is nearer random
    assert len(np.unique(trace.expert_ids[:, 8])) > min(num_experts, 2 * top_k)  # the hot set moves


def test_qwen3_calibration() -> None:
    """Cold LRU per layer (floor(share x 128) slots) over a 2,000-token stream; 24 layers keep the
    test fast and give the 48-layer figures within a point."""
    trace = synthetic_trace("qwen3", 24, 128, 8, 2000, seed=0)
    loc = routing_locality(trace)
    assert abs(loc.prev_overlap.mean() - 0.45) <= TOLERANCE
    assert abs(loc.within_window.mean() - 0.80) <= TOLERANCE
    assert loc.median_reuse_distance == 2
    assert 0.04 <= loc.top_expert_mass.mean() <= 0.06
    for share, published in QWEN3_LRU_CURVE.items():
        slots = int(share * 128)
        groups = tuple(GroupPlan(layer, (layer,), 128, 8, 1, slots) for layer in range(24))
        # the textbook cold LRU of the published curve: every miss inserted at once
        result = replay(trace, CachePlan(groups, budget_bytes=24 * slots), "lru", PolicyConfig(), landing=False,
                        lag=0)
        assert abs(result.hit_ratio - published) <= TOLERANCE, (share, result.hit_ratio)


def test_mixtral_calibration() -> None:
    loc = routing_locality(synthetic_trace("mixtral", 32, 8, 2, 2000, seed=0))
    # share of tokens with an expert in common with the previous token (chance: 46%)
    assert abs(loc.any_prev_overlap[0] - 0.475) <= TOLERANCE
    assert abs(loc.any_prev_overlap[8:24].mean() - 0.645) <= TOLERANCE


def test_synthetic_source_streams_are_independent() -> None:
    source = SyntheticSource(LOCALITY_MODELS["qwen3"], num_layers=8, num_experts=128, top_k=8, seed=0)
    steps = np.stack([source.next_step(4) for _ in range(300)])  # [steps, layers, streams, top_k]
    assert steps.shape == (300, 8, 4, 8)

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        return float((a[..., :, None] == b[..., None, :]).any(-1).mean())

    same_stream = overlap(steps[1:, 4:, 0], steps[:-1, 4:, 0])
    across_streams = overlap(steps[:, 4:, 0], steps[:, 4:, 1])
    assert same_stream > 0.3 and across_streams < same_stream / 2


def test_route_advances_a_stream_once_per_occurrence() -> None:
    trace = synthetic_trace("mixtral", 2, 8, 2, 10)
    source = TraceSource(trace)
    out = source.route(["a", "a", "a", "b"])  # a prefill chunk of 3 tokens, and a decode token
    assert out.shape == (2, 4, 2)
    assert np.array_equal(out[:, :3], trace.expert_ids[:3].transpose(1, 0, 2))
    assert np.array_equal(source.route(["a"])[:, 0], trace.expert_ids[3])
    b_start = int(0.618034 * 10)  # the second stream starts at a golden-ratio offset
    assert np.array_equal(out[:, 3], trace.expert_ids[b_start])


def test_trace_source_wraps_and_a_released_stream_is_replaced_by_a_fresh_one() -> None:
    trace = synthetic_trace("mixtral", 1, 8, 2, 3)
    source = TraceSource(trace)
    tokens = [source.next_step(1)[0, 0].tolist() for _ in range(4)]
    assert tokens == [trace.expert_ids[t % 3, 0].tolist() for t in range(4)]
    source.release(0)
    # the second stream ever started begins at int(0.618 x 3) = 1; the third at int(1.236 x 3) % 3 = 0
    assert source.route(["new"])[0, 0].tolist() == trace.expert_ids[1, 0].tolist()
    assert source.next_step(1)[0, 0].tolist() == trace.expert_ids[0, 0].tolist()


def test_parse_routing(tmp_path: Path) -> None:
    assert parse_routing("model", 4, 8, 2) is None
    assert isinstance(parse_routing("synthetic:mixtral", 4, 8, 2), SyntheticSource)
    path = tmp_path / "t.npz"
    synthetic_trace("mixtral", 4, 8, 2, 20).save(path)
    source = parse_routing(f"trace:{path}", 4, 8, 2)
    assert isinstance(source, TraceSource) and source.next_step(3).shape == (4, 3, 2)
    with pytest.raises(ValueError, match=r"\(layers, experts, top_k\) = \(4, 8, 2\)"):
        parse_routing(f"trace:{path}", 48, 128, 8)
    with pytest.raises(ValueError, match="unknown synthetic routing 'gpt'"):
        parse_routing("synthetic:gpt", 4, 8, 2)
    with pytest.raises(ValueError, match="expected model, trace:FILE"):
        parse_routing("random", 4, 8, 2)


def test_replay_router_draws_ahead_without_changing_any_stream() -> None:
    """The router draws each stream's next token while the device computes; the tokens a step gets are
    those the stream would give without drawing ahead (a trace replays identically either way)."""
    trace = synthetic_trace("qwen3", 4, 16, 2, 40, seed=3)
    ahead = ReplayRouter(TraceSource(trace), 4, 8, TopKRouter(2, norm_topk=True), device=torch.device("cpu"))
    plain = TraceSource(trace)
    steps = [["a"] * 3, ["a"], ["a"], ["a", "b"], ["b", "a"], ["b"]]  # a prefill chunk, decode steps, a join
    for keys in steps:
        ahead.begin_step(keys)
        got = ahead.ids[:len(keys)].numpy().transpose(1, 0, 2)  # [layers, tokens, top_k]
        assert np.array_equal(got, plain.route(keys)), keys
        ahead.while_running()
    ahead.release("a")
    assert "a" not in ahead._ahead
