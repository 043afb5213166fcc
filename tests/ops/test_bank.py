"""A bank of experts checks its shapes, and one expert's size is the same count everywhere; merged gate/up
experts are read as views."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from ops import quants
from ops.bank import ExpertWeights, expert_bytes, random_expert_weights, row_bytes, split_gate_up
from ops.expert_ffn import expert_ffn_reference, native_supports
from ops.grouped_gemm import expert_ffn_grouped_gemm
from ops.quants import QType

HIDDEN, FF = 512, 256


def test_expert_weights_checks_row_bytes() -> None:
    w = random_expert_weights(2, HIDDEN, FF, QType.Q4_K, seed=13)
    assert w.gate.shape == (2, FF, row_bytes(QType.Q4_K, HIDDEN))
    with pytest.raises(ValueError, match="down"):
        ExpertWeights(w.gate, w.up, w.down, QType.Q4_K, QType.Q4_K, QType.Q6_K, HIDDEN, FF)


@pytest.mark.parametrize("types", [(QType.Q4_K,) * 3, (QType.Q4_K, QType.Q4_K, QType.Q6_K),
                                   (QType.Q8_0, QType.F16, QType.Q5_K)], ids=lambda t: "-".join(q.name for q in t))
def test_expert_bytes_counts_gate_up_and_down(types: tuple[QType, QType, QType]) -> None:
    w = random_expert_weights(3, HIDDEN, FF, *types, seed=1)
    stored = sum(t[0].numel() for t in (w.gate, w.up, w.down))
    assert w.expert_bytes == expert_bytes(*types, HIDDEN, FF) == stored


def test_row_bytes_agree_with_the_formats_and_know_every_ggml_type() -> None:
    for qtype in quants.supported_types():
        assert row_bytes(qtype, 512) == quants.row_bytes(qtype, 512)
    assert row_bytes(QType.IQ2_XXS, 512) == 2 * 66  # a type no path computes, still sized
    with pytest.raises(ValueError, match="not a multiple of 256"):
        row_bytes(QType.Q4_K, 300)


def test_merged_gate_up_experts_are_views_that_every_path_reads() -> None:
    """Gemma 4's `ffn_gate_up_exps` ([experts, 2 * ff, row bytes], gate rows first) split without a copy: the
    bank's paths give what they give on the same experts stored apart; the native kernel, which reads whole
    contiguous matrices, declines it; rows that are not whole are refused."""
    w = random_expert_weights(4, HIDDEN, FF, QType.Q8_0, seed=3)
    merged = torch.cat([w.gate, w.up], dim=1)
    gate, up = split_gate_up(merged)
    assert gate.data_ptr() == merged.data_ptr() and torch.equal(up, w.up)
    views = replace(w, gate=gate, up=up)
    assert not views.is_contiguous and not native_supports(views)
    gen = torch.Generator().manual_seed(0)
    x, rows = torch.randn(3, HIDDEN, generator=gen), torch.tensor([0, 3, -1, 2, 3, 1])
    tokens, weights = torch.tensor([0, 0, 1, 1, 2, 2]), torch.rand(6, generator=gen)
    for ffn in (expert_ffn_reference, partial(expert_ffn_grouped_gemm, dtype=torch.float32)):
        assert torch.allclose(ffn(x, tokens, rows, weights, views), ffn(x, tokens, rows, weights, w), atol=1e-6)
    with pytest.raises(ValueError, match="each expert contiguous"):
        replace(w, gate=merged[:, ::2])
