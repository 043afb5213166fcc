"""A bank of experts checks its shapes, and one expert's size is the same count everywhere; merged gate/up
experts are read as views."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from ops import quants
from ops.bank import (
    ExpertWeights,
    expert_bytes,
    gguf_experts,
    random_expert_weights,
    row_bytes,
    split_gate_up,
    to_planar,
)
from ops.cpu_experts import expert_ffn_tiled
from ops.expert_ffn import expert_ffn, expert_ffn_reference, native_supports
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
    bank's paths (the native kernel with its expert strides among them) give what they give on the same experts
    stored apart; rows that are not whole are refused."""
    w = random_expert_weights(4, HIDDEN, FF, QType.Q8_0, seed=3)
    merged = torch.cat([w.gate, w.up], dim=1)
    gate, up = split_gate_up(merged)
    assert gate.data_ptr() == merged.data_ptr() and torch.equal(up, w.up)
    views = replace(w, gate=gate, up=up)
    assert not views.is_contiguous
    gen = torch.Generator().manual_seed(0)
    x, rows = torch.randn(3, HIDDEN, generator=gen), torch.tensor([0, 3, -1, 2, 3, 1])
    tokens, weights = torch.tensor([0, 0, 1, 1, 2, 2]), torch.rand(6, generator=gen)
    paths = [expert_ffn_reference, partial(expert_ffn_grouped_gemm, dtype=torch.float32)]
    if native_supports(views):  # a C compiler: the kernel steps over the other half of each merged expert
        paths.append(expert_ffn)
    for ffn in paths:
        assert torch.allclose(ffn(x, tokens, rows, weights, views), ffn(x, tokens, rows, weights, w), atol=1e-6)
    with pytest.raises(ValueError, match="each expert contiguous"):
        replace(w, gate=merged[:, ::2])


def test_planar_mxfp4_puts_each_rows_codes_on_16_bytes_and_comes_back() -> None:
    """`to_planar`: a group of 16 rows holds the rows' code bytes, row after row, then their e8m0 scales; the other
    formats' matrices are shared as they are; `gguf_experts` gives GGUF's bytes back."""
    hidden, ff = 224, 160  # rows of 7 and 5 blocks
    bank = random_expert_weights(3, hidden, ff, QType.MXFP4, QType.Q4_0, QType.MXFP4, seed=5)
    planar = to_planar(bank)
    assert planar.planar and not bank.planar and planar.up is bank.up and to_planar(planar) is planar
    assert planar.gate.shape == bank.gate.shape and not torch.equal(planar.gate, bank.gate)
    for got, raw, cols in ((planar.gate[2], bank.gate[2], hidden), (planar.down[1], bank.down[1], ff)):
        blocks, row = cols // 32, cols // 32 * 17
        for r in (0, 5, 16, 17, raw.shape[0] - 1):
            group, i = got.flatten()[r // 16 * 16 * row:], r % 16
            gguf = raw[r].view(blocks, 17)
            assert torch.equal(group[i * blocks * 16:(i + 1) * blocks * 16], gguf[:, 1:].flatten())
            scales = group[16 * blocks * 16 + i * blocks:]
            assert torch.equal(scales[:blocks], gguf[:, 0])
    back = gguf_experts(planar, slice(1, 3))
    assert all(torch.equal(a, b[1:3]) for a, b in zip(back, (bank.gate, bank.up, bank.down)))
    assert to_planar(random_expert_weights(1, hidden, ff, QType.Q4_0, seed=1)).planar is False


def test_the_torch_paths_read_a_planar_bank_as_its_gguf_bytes() -> None:
    """The reference and the CPU's torch tiles compute a planar bank's experts as the GGUF bank's (a resident bank
    read where no planar kernel runs)."""
    bank = random_expert_weights(4, 256, 192, QType.MXFP4, seed=7)
    planar = to_planar(bank)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=generator)
    token_ids, rows = torch.arange(5).repeat_interleave(2), torch.tensor([0, 3, 1, 3, 2, 0, 3, 1, 2, 2])
    weights = torch.rand(10, generator=generator)
    want = expert_ffn_reference(x, token_ids, rows, weights, bank)
    assert torch.equal(expert_ffn_reference(x, token_ids, rows, weights, planar), want)
    assert not native_supports(planar)
    torch.testing.assert_close(expert_ffn_tiled(x, token_ids, rows, weights, planar),
                               expert_ffn_tiled(x, token_ids, rows, weights, bank), rtol=0, atol=0)
