"""Staging of missed experts into VRAM (`ops.triton.stage`) before the grouped FFN reads them.

Fresh random experts every run. A host bank (pinned on CUDA), a pool holding some experts in slots and
a poisoned staging bank: after `stage_experts`, the staging row of every selected, uncached expert holds
exactly its host bytes; the rows of cached or unselected experts are untouched, and so is the pool. Then
the grouped FFN through the staged tables equals the float32 torch reference on the host bank.

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA the same checks run on small shapes under Triton's
interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles anything).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from ops.cpu_experts import ExpertWeights
from ops.expert_ffn import expert_ffn_torch
from ops.quants import QType

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU expert kernels need it")

from ops.triton import grouped_expert_ffn, stage_experts, tables_from_bank  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402
from tests.ops.test_triton_experts import RTOL, Case, on_device, random_bank, random_routing, relative_error  # noqa: E402

POISON = 0xA5
CASES = [
    Case((QType.Q4_K, QType.Q4_K, QType.Q4_K), num_tokens=1),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=5, dtype=torch.bfloat16),
    Case((QType.Q8_0, QType.Q8_0, QType.Q8_0), num_tokens=32, num_experts=16, top_k=8),
]


def _pointed(tables, cached: dict[int, int], pool: ExpertWeights):  # noqa: ANN001, ANN202
    """Tables whose cached experts point at their pool slot."""
    for part, ptrs in (("gate", tables.gate_ptrs), ("up", tables.up_ptrs), ("down", tables.down_ptrs)):
        ptrs = ptrs.clone()
        t = getattr(pool, part)
        for expert, slot in cached.items():
            ptrs[expert] = t.data_ptr() + slot * t.stride(0)
        tables = replace(tables, **{f"{part}_ptrs": ptrs})
    return tables


def run_case(case: Case, device: torch.device, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = random_routing(case, generator)
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(case.dtype)
    host = on_device(bank, device, pin=device.type == "cuda")
    cached = {e: slot for slot, e in enumerate(torch.randperm(case.num_experts, generator=generator)[:3].tolist())}
    pool = on_device(ExpertWeights(*(getattr(bank, p)[list(cached)] for p in ("gate", "up", "down")),
                                   bank.gate_type, bank.up_type, bank.down_type, bank.hidden, bank.ff), device)
    pool_before = [getattr(pool, p).clone() for p in ("gate", "up", "down")]
    staging = ExpertWeights(*(torch.full_like(getattr(bank, p), POISON, device=device) for p in ("gate", "up", "down")),
                            bank.gate_type, bank.up_type, bank.down_type, bank.hidden, bank.ff)
    src = _pointed(tables_from_bank(host, device), cached, pool)
    dst = _pointed(tables_from_bank(staging, device), cached, pool)

    stage_experts(expert_ids.to(device), src, dst)
    selected = {e for e in expert_ids.tolist() if e >= 0}
    for part in ("gate", "up", "down"):
        rows, ref = getattr(staging, part).cpu(), getattr(bank, part)
        for e in range(case.num_experts):
            if e in selected and e not in cached:
                assert torch.equal(rows[e], ref[e]), f"{part} of expert {e}: not staged"
            else:
                assert (rows[e] == POISON).all(), f"{part} of expert {e}: written but cached or unselected"
    for before, part in zip(pool_before, ("gate", "up", "down")):
        assert torch.equal(getattr(pool, part), before), f"the pool's {part} rows changed"

    out = grouped_expert_ffn(x.to(device), token_ids.to(device), expert_ids.to(device), weights.to(device), dst)
    error = relative_error(out, expert_ffn_torch(x, token_ids, expert_ids, weights, bank))
    assert error < RTOL, f"{case}: relative error {error:.2e}"
    return error


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.types[0].name}-{c.types[2].name}-t{c.num_tokens}")
def test_staged_experts_match_the_host_bank_and_the_reference(case: Case) -> None:
    run_case(case, torch.device("cuda"), int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
def test_tables_of_other_shapes_are_refused() -> None:
    bank = random_bank(CASES[0], torch.Generator().manual_seed(0))
    other = random_bank(replace(CASES[0], types=(QType.Q8_0,) * 3), torch.Generator().manual_seed(0))
    a, b = on_device(bank, torch.device("cuda")), on_device(other, torch.device("cuda"))
    with pytest.raises(ValueError, match="other types"):
        stage_experts(torch.zeros(1, dtype=torch.int64, device="cuda"), tables_from_bank(a, torch.device("cuda")),
                      tables_from_bank(b, torch.device("cuda")))


# --- the interpreter (no CUDA) ----------------------------------------------------------------------------

INTERPRETER_CASES = [replace(CASES[0], hidden=256, ff=256), replace(CASES[1], hidden=256, ff=256, num_tokens=3)]
INTERPRETER_CHECKS = [(str(c.types), lambda seed, c=c: run_case(c, torch.device("cpu"), seed))
                      for c in INTERPRETER_CASES]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
