"""The one expert-FFN signature: each path that runs on the CPU gives the reference's result for pairs in any
order, several per token or none, with the pairs of row -1 skipped."""

from __future__ import annotations

import functools

import pytest
import torch

from ops.bank import random_expert_weights
from ops.expert_ffn import ExpertFFN, expert_ffn, expert_ffn_reference
from ops.grouped_gemm import expert_ffn_grouped_gemm, grouped_gemm_available
from ops.quants import QType

HIDDEN, FF, ROWS = 256, 256, 5
# float weights: the native kernel's int8 activations (a quantized bank) are checked in test_cpu_experts.py
FLOAT_TYPES = (QType.F16, QType.BF16, QType.F32)

PATHS: dict[str, ExpertFFN] = {"expert_ffn": expert_ffn}
if grouped_gemm_available(torch.device("cpu")):
    PATHS["grouped_gemm"] = functools.partial(expert_ffn_grouped_gemm, dtype=torch.float32)


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_gives_the_reference_result(path: str) -> None:
    generator = torch.Generator().manual_seed(4)
    bank = random_expert_weights(ROWS, HIDDEN, FF, *FLOAT_TYPES, seed=5)
    # tokens 0 .. 5 in random order, rows -1 among them; token 6: one skipped pair; token 7: none
    token_ids = torch.cat([torch.randint(0, 6, (22,), generator=generator), torch.tensor([6])])
    rows = torch.cat([torch.randint(-1, ROWS, (22,), generator=generator), torch.tensor([-1])])
    weights = torch.rand(23, generator=generator)
    x = torch.randn(8, HIDDEN, generator=generator)
    out = PATHS[path](x, token_ids, rows, weights, bank)
    reference = expert_ffn_reference(x, token_ids, rows, weights, bank)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert float((out - reference).norm() / reference.norm()) < 1e-5
    assert not out[6:].any()
