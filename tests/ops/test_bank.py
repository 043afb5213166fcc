"""A bank of experts checks its shapes, and one expert's size is the same count everywhere."""

from __future__ import annotations

import pytest

from ops import quants
from ops.bank import ExpertWeights, expert_bytes, random_expert_weights, row_bytes
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
