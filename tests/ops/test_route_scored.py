"""The scored router (`ops.fused.route_topk_scored`: DeepSeek-V2/V3 routing) against a per-token loop written
from the papers' definitions, and its plain case against the softmax top-k reference."""

from __future__ import annotations

import pytest
import torch

from ops.fused import route_topk_scored, route_topk_torch, routed_weights_scored


def loop_reference(logits: torch.Tensor, top_k: int, norm: bool, sigmoid: bool, bias: torch.Tensor,
                   num_groups: int, topk_groups: int, group_by_max: bool, scale: float) -> list[dict[int, float]]:
    """Per token: {expert: weight}, one expert at a time."""
    out = []
    for row in logits.float():
        scores = torch.sigmoid(row) if sigmoid else torch.softmax(row, dim=0)
        choice = (scores + bias).tolist()
        size = len(choice) // num_groups
        groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(num_groups)]
        group_score = [g[0] if group_by_max else g[0] + g[1] for g in groups]
        best = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        eligible = [e for e in range(len(choice)) if e // size in best]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        total = sum(float(scores[e]) for e in chosen) if norm else 1.0
        out.append({e: float(scores[e]) / total * scale for e in chosen})
    return out


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("group_by_max", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_grouped_choice_matches_the_loop(sigmoid: bool, group_by_max: bool, norm: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(37, 16, generator=gen), torch.randn(16, generator=gen) * 0.1
    ids, weights = route_topk_scored(logits, 3, norm, sigmoid=sigmoid, score_bias=bias, num_groups=4,
                                     topk_groups=2, group_by_max=group_by_max, scale=2.5)
    expected = loop_reference(logits, 3, norm, sigmoid, bias, 4, 2, group_by_max, 2.5)
    for token, want in enumerate(expected):
        got = dict(zip(ids[token].tolist(), weights[token].tolist(), strict=True))
        assert got.keys() == want.keys()
        assert all(got[e] == pytest.approx(w, rel=1e-6) for e, w in want.items())
    again_ids, again_weights = routed_weights_scored(logits, ids, norm, sigmoid=sigmoid, scale=2.5)
    assert torch.equal(again_ids, ids) and torch.equal(again_weights, weights)  # a trace's weights


def test_plain_case_is_softmax_top_k() -> None:
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([True] * 7 + [False] * 2)
    for norm in (False, True):
        ids, weights = route_topk_scored(logits, 2, norm, mask)
        ref_ids, ref_weights = route_topk_torch(logits, 2, norm, mask)
        assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_weights)
        assert (ids[7:] == -1).all()


def test_the_bias_moves_the_choice_not_the_weights() -> None:
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    ids, weights = route_topk_scored(logits, 1, False, sigmoid=True, score_bias=bias)
    assert ids.tolist() == [[2]] and weights.tolist() == [[0.5]]  # sigmoid(0): the unbiased score
