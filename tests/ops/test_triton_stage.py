"""Streamed misses copied into VRAM inside the expert kernels (`ops.triton.stage`), and the separate fill
launch of formats without fused kernels; a list of experts gathered from any addresses into one bank (a prompt's
staged layer).

Fresh random experts every run. A host bank (pinned on CUDA), a pool holding some experts in slots, and
a poisoned staging bank; the table the FFN reads points each selected expert at its pool slot (cached,
flag 0; or landing, flag 1) or its staging row (flag 1). After the grouped FFN with `fill`, every
flagged expert's rows hold exactly its host bytes, the rows of other experts are untouched, and the
result equals the float32 torch reference on the host bank (plus the `extra` partial sum).

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA the same checks run on small shapes under Triton's
interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles anything).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from ops.bank import ExpertWeights
from ops.expert_ffn import expert_ffn_reference
from ops.quants import QType

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU expert kernels need it")

from ops.triton import Fill, gather_experts, grouped_expert_ffn, hold, hold_fills, tables_from_bank  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402
from tests.ops.test_triton_experts import Case, on_device, random_bank, random_routing, relative_error, tolerance  # noqa: E402

POISON = 0xA5
PARTS = ("gate", "up", "down")
CASES = [
    Case((QType.Q4_K, QType.Q4_K, QType.Q4_K), num_tokens=1),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=5, dtype=torch.bfloat16),
    Case((QType.Q8_0, QType.Q8_0, QType.Q8_0), num_tokens=32, num_experts=16, top_k=8),
    Case((QType.IQ4_XS, QType.F16, QType.Q8_0), num_tokens=3),  # no fused kernel: a fill launch first
]


def _pointing(tables, rows: dict[int, tuple[ExpertWeights, int]]):  # noqa: ANN001, ANN202
    """Tables whose listed experts point at (bank, row)."""
    for part in PARTS:
        ptrs = getattr(tables, f"{part}_ptrs").clone()
        for expert, (bank, row) in rows.items():
            t = getattr(bank, part)
            ptrs[expert] = t.data_ptr() + row * t.stride(0)
        tables = replace(tables, **{f"{part}_ptrs": ptrs})
    return tables


def run_case(case: Case, device: torch.device, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = random_routing(case, generator)
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(case.dtype)
    host = on_device(bank, device, pin=device.type == "cuda")
    order = torch.randperm(case.num_experts, generator=generator).tolist()
    cached, landing = order[:2], order[2:4]  # the rest: staged when selected
    pool = ExpertWeights(*(torch.full((4, *getattr(bank, p).shape[1:]), POISON, dtype=torch.uint8, device=device)
                           for p in PARTS), bank.gate_type, bank.up_type, bank.down_type, bank.hidden, bank.ff)
    for slot, e in enumerate(cached):
        for p in PARTS:
            getattr(pool, p)[slot] = getattr(bank, p)[e].to(device)
    staging = ExpertWeights(*(torch.full_like(getattr(bank, p), POISON, device=device) for p in PARTS),
                            bank.gate_type, bank.up_type, bank.down_type, bank.hidden, bank.ff)
    read = _pointing(tables_from_bank(staging, device),
                     {e: (pool, slot) for slot, e in enumerate(cached + landing)})
    flags = torch.ones(case.num_experts, dtype=torch.int8)
    flags[cached] = 0
    fill = Fill(flags.to(device), tables_from_bank(host, device))
    extra = torch.randn(case.num_tokens, case.hidden, generator=generator)
    out = grouped_expert_ffn(x.to(device), token_ids.to(device), expert_ids.to(device), weights.to(device), read,
                             fill=fill, extra=extra.pin_memory() if device.type == "cuda" else extra)
    reference = expert_ffn_reference(x, token_ids, expert_ids, weights, bank) + extra
    selected = {e for e in expert_ids.tolist() if e >= 0}
    for part in PARTS:
        rows, slots, ref = getattr(staging, part).cpu(), getattr(pool, part).cpu(), getattr(bank, part)
        for slot, e in enumerate(cached + landing):
            want_filled = e in cached or e in selected
            assert torch.equal(slots[slot], ref[e]) if want_filled else bool((slots[slot] == POISON).all()), \
                f"{part} of expert {e} in slot {slot}"
        for e in range(case.num_experts):
            if e in selected and e not in cached + landing:
                assert torch.equal(rows[e], ref[e]), f"{part} of expert {e}: not staged"
            else:
                assert (rows[e] == POISON).all(), f"{part} of expert {e}: staged but not a staged miss"
    error = relative_error(out, reference)
    assert error < tolerance(case), f"{case}: relative error {error:.2e}"
    return error


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.types[0].name}-{c.types[2].name}-t{c.num_tokens}")
def test_filled_experts_match_the_host_bank_and_the_reference(case: Case) -> None:
    run_case(case, torch.device("cuda"), int(torch.randint(1 << 30, ())))


def check_gather(device: torch.device, seed: int) -> None:
    """Experts of two banks (a pool on the device, a host bank: pinned on CUDA) gathered by address into rows of a
    poisoned bank, in a mixed order: each row named holds its source's bytes, the others stay poisoned; 3 programs
    for more blocks than programs."""
    generator = torch.Generator().manual_seed(seed)
    shape = (6, 3, 16448)  # 49,344 bytes an expert: three blocks of the kernel, the last one partial
    pool = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)
    host = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    host = host.pin_memory() if device.type == "cuda" else host
    picks = {0: (pool, 4), 1: (host, 0), 3: (host, 5), 4: (pool, 0), 6: (host, 2)}  # row 2 and 5 not staged
    dst = torch.full((7, *shape[1:]), POISON, dtype=torch.uint8, device=device)
    sources = torch.tensor([t.data_ptr() + row * t.stride(0) for t, row in picks.values()], dtype=torch.int64,
                           device=device)
    rows = torch.tensor(list(picks), dtype=torch.int64, device=device)
    gather_experts(sources, rows, dst, programs=3)
    for e in range(dst.shape[0]):
        if e in picks:
            t, row = picks[e]
            assert torch.equal(dst[e].cpu(), t[row].cpu()), f"expert {e} from {t.device} row {row}"
        else:
            assert bool((dst[e] == POISON).all()), f"expert {e} was not named"
    with pytest.raises(ValueError, match="rows"):
        gather_experts(sources, rows[:2], dst)
    with pytest.raises(ValueError, match="contiguous"):
        gather_experts(sources, rows, dst[:, :, :16])


@pytest.mark.gpu
def test_gather_copies_each_expert_from_its_address() -> None:
    check_gather(torch.device("cuda"), int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
def test_fill_tables_of_other_shapes_are_refused() -> None:
    bank = random_bank(CASES[0], torch.Generator().manual_seed(0))
    other = random_bank(replace(CASES[0], types=(QType.Q8_0,) * 3), torch.Generator().manual_seed(0))
    cuda = torch.device("cuda")
    a, b = on_device(bank, cuda), on_device(other, cuda)
    fill = Fill(torch.ones(bank.num_experts, dtype=torch.int8, device=cuda), tables_from_bank(b, cuda))
    x = torch.zeros(1, bank.hidden, device=cuda)
    one = torch.zeros(1, dtype=torch.int64, device=cuda)
    with pytest.raises(ValueError, match="other experts"):
        grouped_expert_ffn(x, one, one, one.float(), tables_from_bank(a, cuda), fill=fill)


def elapsed_ms(launch: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@pytest.mark.gpu
def test_hold_keeps_the_stream_busy_for_its_time() -> None:
    cuda = torch.device("cuda")
    hold(2_000_000, cuda)  # compiled before it is timed
    assert 2.0 <= elapsed_ms(lambda: hold(2_000_000, cuda)) < 2.8
    assert elapsed_ms(lambda: hold(0, cuda)) < 0.5


@pytest.mark.gpu
def test_hold_fills_waits_once_per_distinct_flagged_expert() -> None:
    cuda = torch.device("cuda")
    flags = torch.zeros(16, dtype=torch.int8, device=cuda)
    flags[[3, 7, 9]] = 1
    ids = torch.tensor([3, 3, 5, 7, -1, 7, 20, 3], device=cuda)  # 3 and 7 flagged (twice, thrice); 9 not chosen
    hold_fills(ids, flags, 1_000_000)  # each shape compiled before it is timed
    hold_fills(ids[2:3], flags, 1_000_000)
    assert 2.0 <= elapsed_ms(lambda: hold_fills(ids, flags, 1_000_000)) < 2.8
    assert elapsed_ms(lambda: hold_fills(ids[2:3], flags, 1_000_000)) < 0.5  # expert 5: no fill


# --- the interpreter (no CUDA) ----------------------------------------------------------------------------

INTERPRETER_CASES = [replace(CASES[0], hidden=256, ff=256), replace(CASES[1], hidden=256, ff=256, num_tokens=3),
                     replace(CASES[3], hidden=256, ff=256),
                     # groups of ~5 pairs in passes of 2: cached experts' passes side by side, streamed ones' in one
                     # program (it copies the expert first)
                     replace(CASES[2], hidden=256, ff=256, num_tokens=7, num_experts=6, top_k=4, block_tokens=2)]
INTERPRETER_CHECKS = [(str(c.types), lambda seed, c=c: run_case(c, torch.device("cpu"), seed))
                      for c in INTERPRETER_CASES]
INTERPRETER_CHECKS.append(("gather", lambda seed: check_gather(torch.device("cpu"), seed)))


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
