"""The fused prefill expert GEMMs (`ops.triton.moe_gemm`) against the torch reference `expert_ffn_reference`.

Fresh random inputs every run: valid random GGUF blocks; routing where one expert gets no pair, one exactly
one, one most tokens (several tiles of BLOCK_M), about 1 in 6 pairs skipped (-1), pairs shuffled. The CUDA
tests (`@pytest.mark.gpu`) run Qwen3-30B-A3B's shapes; without CUDA the same checks run on tiny shapes under
Triton's interpreter in a subprocess (see tests/ops/interpreter.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import pytest
import torch

from ops import quants
from ops.bank import ExpertWeights, to_planar
from ops.cpu_experts import QType
from ops.expert_ffn import expert_ffn_reference
from ops.expert_math import ExpertMath

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU expert kernels need it")

from ops.grouped_gemm import PREFILL_EXPERTS, expert_ffn_grouped_gemm, prefill_experts  # noqa: E402
from ops.triton import tables_from_bank  # noqa: E402
from ops.triton.moe_gemm import MoeGemmConfig, covers, expert_ffn_moe_gemm  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

# ||out - ref|| / ||ref||. The reference multiplies in float32 with exact weights; the kernels round every weight
# and h to bf16 (8 significant bits: 2**-9 relative each) before tensor-core products accumulated in float32:
# measured ~3.5e-3 over three matrices. A wrong scale, nibble order or pair's expert gives > 5e-2
# (`test_the_tolerance_sees_wrong_scales_nibbles_and_experts`).
RTOL = 1e-2

Types = tuple[QType, QType, QType]


@dataclass(frozen=True)
class Case:
    types: Types
    num_tokens: int
    hidden: int = 256
    ff: int = 256
    num_experts: int = 8
    top_k: int = 2
    activation: str = "silu"
    biases: bool = False
    config: MoeGemmConfig = MoeGemmConfig(block_m=16)
    planar: bool = False  # the bank's MXFP4 matrices in `ops.bank.to_planar`'s order (a resident bank's)


def random_bank(case: Case, generator: torch.Generator) -> ExpertWeights:
    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, case.num_experts * rows * blocks, generator).view(case.num_experts, rows, -1)

    def bias(cols: int, scale: float) -> torch.Tensor | None:
        return scale * torch.randn(case.num_experts, cols, generator=generator) if case.biases else None

    # biases of about the projections' outputs (weights ~0.02, x ~1): a dropped bias shows, and so does a wrong
    # matmul beside them
    math = ExpertMath(case.activation, bias(case.ff, 0.3), bias(case.ff, 0.3), bias(case.hidden, 0.02))  # type: ignore[arg-type]
    gate_type, up_type, down_type = case.types
    return ExpertWeights(projection(gate_type, case.ff, case.hidden), projection(up_type, case.ff, case.hidden),
                         projection(down_type, case.hidden, case.ff), *case.types, case.hidden, case.ff, math)


def random_routing(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_ids, bank rows, weights `[pairs]`: expert 0 never chosen, expert 1 by token 0 only, expert 2 by every
    token (scored first), the rest at random; about 1 in 6 pairs skipped; shuffled."""
    scores = torch.rand(case.num_tokens, case.num_experts, generator=generator)
    scores[:, :2], scores[:, 2] = -1.0, 2.0
    rows = scores.topk(case.top_k, dim=1).indices
    rows[0, -1] = 1
    token_ids = torch.arange(case.num_tokens).repeat_interleave(case.top_k)
    rows = rows.flatten()
    is_skipped = (torch.rand(rows.shape, generator=generator) < 1 / 6) & (rows > 1)  # keep expert 1's pair
    rows = torch.where(is_skipped, -1, rows)
    order = torch.randperm(rows.shape[0], generator=generator)
    return token_ids[order], rows[order], torch.rand(rows.shape, generator=generator)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def on_device(bank: ExpertWeights, device: torch.device) -> ExpertWeights:
    return ExpertWeights(bank.gate.to(device), bank.up.to(device), bank.down.to(device), bank.gate_type,
                         bank.up_type, bank.down_type, bank.hidden, bank.ff, bank.math.to(device))


def inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...],
                                                                   ExpertWeights, torch.Tensor]:
    """x (bf16), (token_ids, rows, weights), the bank, all on device, and the reference output (float32)."""
    generator = torch.Generator().manual_seed(seed)
    bank = on_device(random_bank(case, generator), device)
    pairs = tuple(t.to(device) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).bfloat16().to(device)
    ref = expert_ffn_reference(x, *pairs, bank)  # GGUF's blocks
    return x, pairs, to_planar(bank) if case.planar else bank, ref


def run_case(case: Case, device: torch.device, seed: int) -> float:
    x, pairs, bank, ref = inputs(case, device, seed)
    out = expert_ffn_moe_gemm(x, *pairs, bank, case.config)
    assert out.dtype == torch.float32 and out.isfinite().all()
    error = relative_error(out, ref)
    assert error < RTOL, f"{case}: relative error {error:.2e}"
    return error


def check_deterministic_and_empty(case: Case, device: torch.device, seed: int) -> None:
    """The same bits every run; all pairs skipped gives zeros."""
    x, pairs, bank, _ = inputs(case, device, seed)
    first = expert_ffn_moe_gemm(x, *pairs, bank, case.config)
    assert torch.equal(first, expert_ffn_moe_gemm(x, *pairs, bank, case.config))
    token_ids, rows, weights = pairs
    none = expert_ffn_moe_gemm(x, token_ids, torch.full_like(rows, -1), weights, bank, case.config)
    assert none.shape == first.shape and not none.any()


def check_token_major_pairs(case: Case, device: torch.device, seed: int) -> None:
    """Pairs token by token (a prompt's routing flattened): told so, the kernels sum each token's pairs without
    sorting them, to the same bits; a count that does not fit is refused."""
    x, (token_ids, rows, weights), bank, _ = inputs(case, device, seed)
    order = torch.argsort(token_ids, stable=True)
    pairs = token_ids[order], rows[order], weights[order]
    got = expert_ffn_moe_gemm(x, *pairs, bank, case.config, pairs_per_token=case.top_k)
    assert torch.equal(got, expert_ffn_moe_gemm(x, *pairs, bank, case.config))
    with pytest.raises(ValueError, match="pairs are not"):
        expert_ffn_moe_gemm(x, *pairs, bank, case.config, pairs_per_token=case.top_k + 1)


def check_experts_where_they_are(case: Case, device: torch.device, seed: int) -> None:
    """Experts read through their addresses, some from a bank's rows and some from other places (a prompt's staged
    layer whose cached experts stay in their slots): the reference's output. The rows whose expert is elsewhere
    hold other bytes, so reading them would show."""
    x, pairs, bank, ref = inputs(case, device, seed)
    elsewhere = [1, 2, case.num_experts - 1]  # expert 1's single pair, expert 2's many
    slot_of = {e: s for s, e in enumerate(reversed(elsewhere))}  # slots in another order than the experts
    slots = [torch.stack([getattr(bank, name)[e] for e in reversed(elsewhere)]) for name in ("gate", "up", "down")]
    staged = bank_with(bank, **{name: getattr(bank, name).clone() for name in ("gate", "up", "down")})
    for name in ("gate", "up", "down"):
        getattr(staged, name)[elsewhere] = getattr(bank, name)[0]  # expert 0's bytes: never routed to
    tables = tables_from_bank(staged, device)
    for name, pool in zip(("gate", "up", "down"), slots, strict=True):
        ptrs = getattr(tables, f"{name}_ptrs").clone()
        for e in elsewhere:
            ptrs[e] = pool.data_ptr() + slot_of[e] * pool.stride(0)
        tables = replace(tables, **{f"{name}_ptrs": ptrs})
    out = expert_ffn_moe_gemm(x, *pairs, tables, case.config)
    assert relative_error(out, ref) < RTOL
    assert relative_error(expert_ffn_moe_gemm(x, *pairs, staged, case.config), ref) > 5 * RTOL


# --- anywhere: the tolerance is tight enough --------------------------------------------------------------


def test_the_tolerance_sees_wrong_scales_nibbles_and_experts() -> None:
    """The reference of a bank with one bug each (nibbles swapped in Q4_K's gate, Q6_K's down scales read one
    sub-block off, one pair's expert changed) differs from the right one by far more than RTOL."""
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=12, top_k=4)
    x, (token_ids, rows, weights), bank, ref = inputs(case, torch.device("cpu"), int(torch.randint(1 << 30, ())))
    gate = bank.gate.clone().view(-1, 144)
    gate[:, 16:] = (gate[:, 16:] >> 4) | (gate[:, 16:] << 4)
    down = bank.down.clone().view(-1, 210)
    down[:, 192:208] = down[:, 192:208].roll(1, dims=1)
    moved = rows.clone()
    moved[rows.argmax()] = 0  # expert 0 has no pair: this one changes
    wrong = [expert_ffn_reference(x, token_ids, rows, weights, bank_with(bank, gate=gate.view_as(bank.gate))),
             expert_ffn_reference(x, token_ids, rows, weights, bank_with(bank, down=down.view_as(bank.down))),
             expert_ffn_reference(x, token_ids, moved, weights, bank)]
    assert all(relative_error(out, ref) > 5 * RTOL for out in wrong)


def bank_with(bank: ExpertWeights, **raw: torch.Tensor) -> ExpertWeights:
    parts = {"gate": bank.gate, "up": bank.up, "down": bank.down} | raw
    return ExpertWeights(parts["gate"], parts["up"], parts["down"], bank.gate_type, bank.up_type, bank.down_type,
                         bank.hidden, bank.ff, bank.math)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_EXPERTS, raising=False)
    assert prefill_experts() == "fused"
    monkeypatch.setenv(PREFILL_EXPERTS, "dequant")
    assert prefill_experts() == "dequant"
    monkeypatch.setenv(PREFILL_EXPERTS, "mmq")
    with pytest.raises(ValueError, match=PREFILL_EXPERTS):
        prefill_experts()


def test_covers_only_the_tile_formats() -> None:
    generator = torch.Generator().manual_seed(0)
    assert covers(random_bank(Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), 1), generator))
    assert covers(random_bank(Case((QType.MXFP4, QType.Q4_0, QType.Q5_K), 1), generator))
    assert not covers(random_bank(Case((QType.Q4_K, QType.Q4_K, QType.IQ4_XS), 1), generator))


def test_config_rejects_blocks_below_the_dot() -> None:
    with pytest.raises(ValueError, match="block_m"):
        MoeGemmConfig(block_m=8)
    with pytest.raises(ValueError, match="block_k"):
        MoeGemmConfig(block_k=48)


# --- CUDA ----------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
# Qwen3-30B-A3B: 128 experts of gate/up [768 x 2048], down [2048 x 768]; a 512-token prompt, top-8
QWEN3 = dict(hidden=2048, ff=768, num_experts=128, top_k=8, config=MoeGemmConfig())
FORMATS: list[Types] = [(QType.Q4_K,) * 3, (QType.Q6_K,) * 3, (QType.Q8_0,) * 3, (QType.Q4_K, QType.Q4_K, QType.Q6_K),
                        (QType.Q5_K, QType.Q4_0, QType.Q8_0), (QType.MXFP4,) * 3]


def seed() -> int:
    return int(torch.randint(1 << 30, ()))


@pytest.mark.gpu
@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_qwen3_layer_matches_reference(types: Types) -> None:
    run_case(Case(types, num_tokens=512, **QWEN3), CUDA, seed())  # type: ignore[arg-type]


@pytest.mark.gpu
def test_gpt_oss_layer_of_planar_mxfp4_matches_reference() -> None:
    """A resident gpt-oss-20b layer (32 experts of 2880 x 2880, top-4, biases, the clamped SwiGLU) in
    `ops.bank.to_planar`'s order, a 512-token prompt."""
    run_case(Case((QType.MXFP4,) * 3, num_tokens=512, hidden=2880, ff=2880, num_experts=32, top_k=4,
                  activation="swiglu_oai", biases=True, config=MoeGemmConfig(), planar=True), CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_tile_sizes(block_m: int) -> None:
    qwen3 = QWEN3 | {"config": MoeGemmConfig(block_m=block_m)}
    run_case(Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=200, **qwen3), CUDA, seed())  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("math", [("silu", True), ("gelu", True), ("swiglu_oai", True), ("swiglu_oai", False)],
                         ids=lambda m: f"{m[0]}{'-biases' if m[1] else ''}")
def test_every_expert_math(math: tuple[str, bool]) -> None:
    case = Case((QType.Q4_0, QType.MXFP4, QType.Q4_0), num_tokens=64, hidden=512, ff=256, num_experts=16, top_k=4,
                activation=math[0], biases=math[1])
    run_case(case, CUDA, seed())


@pytest.mark.gpu
def test_experts_where_they_are() -> None:
    check_experts_where_they_are(Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=512, **QWEN3), CUDA, seed())  # type: ignore[arg-type]


@pytest.mark.gpu
def test_deterministic_and_empty() -> None:
    check_deterministic_and_empty(Case((QType.Q4_K,) * 3, num_tokens=512, **QWEN3), CUDA, seed())  # type: ignore[arg-type]


@pytest.mark.gpu
def test_token_major_pairs() -> None:
    check_token_major_pairs(Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=512, **QWEN3), CUDA, seed())  # type: ignore[arg-type]


@pytest.mark.gpu
def test_the_switch_selects_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=256, **QWEN3)  # type: ignore[arg-type]
    x, pairs, bank, ref = inputs(case, CUDA, seed())
    monkeypatch.setenv(PREFILL_EXPERTS, "fused")
    fused = expert_ffn_grouped_gemm(x, *pairs, bank)
    assert torch.equal(fused, expert_ffn_moe_gemm(x, *pairs, bank))
    monkeypatch.setenv(PREFILL_EXPERTS, "dequant")
    dequant = expert_ffn_grouped_gemm(x, *pairs, bank)
    assert not torch.equal(fused, dequant)
    assert relative_error(fused, ref) < RTOL and relative_error(dequant, ref) < RTOL


@pytest.mark.gpu
def test_launcher_rejects_bad_inputs() -> None:
    x, (token_ids, rows, weights), bank, _ = inputs(Case((QType.Q4_K,) * 3, num_tokens=4), CUDA, 0)
    with pytest.raises(ValueError, match="x"):
        expert_ffn_moe_gemm(x[:, :-16], token_ids, rows, weights, bank)
    with pytest.raises(ValueError, match="bank_rows"):
        expert_ffn_moe_gemm(x, token_ids, rows.float(), weights, bank)
    with pytest.raises(ValueError, match="weights"):
        expert_ffn_moe_gemm(x, token_ids, rows, weights[:-1], bank)
    host = bank_with(bank, gate=bank.gate.cpu(), up=bank.up.cpu(), down=bank.down.cpu())
    with pytest.raises(ValueError, match="gate"):
        expert_ffn_moe_gemm(x, token_ids, rows, weights, host)


# --- the interpreter (no CUDA) ---------------------------------------------------------------------------

# tiny shapes, few programs (the interpreter runs each in numpy): BLOCK_N and BLOCK_K the whole rows but where
# a case checks smaller ones
WIDE = MoeGemmConfig(block_m=16, block_n=256, block_k=256)
INTERPRETER_CASES = [
    Case((QType.Q4_K,) * 3, num_tokens=24, top_k=4, config=WIDE),
    Case((QType.Q6_K,) * 3, num_tokens=16, top_k=3, config=WIDE),
    Case((QType.Q8_0,) * 3, num_tokens=17, top_k=2, config=WIDE),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=20, hidden=512, top_k=4, config=WIDE),
    Case((QType.Q5_K, QType.Q4_0, QType.Q8_0), num_tokens=9, top_k=3, config=WIDE),
    Case((QType.Q4_K,) * 3, num_tokens=1, top_k=2, config=WIDE),  # two pairs: one expert each
    # a super-block over several K steps, several N blocks, BLOCK_M from the pairs per expert
    Case((QType.Q4_K, QType.Q6_K, QType.Q6_K), num_tokens=6, top_k=3, config=MoeGemmConfig(block_n=128, block_k=64)),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=12, top_k=4, activation="gelu", biases=True, config=WIDE),
    Case((QType.Q8_0, QType.Q4_0, QType.Q8_0), num_tokens=10, top_k=2, activation="swiglu_oai", biases=True,
         config=WIDE),
    # gpt-oss's experts: MXFP4 with the clamped SwiGLU and biases; a block over two K steps
    Case((QType.MXFP4,) * 3, num_tokens=10, top_k=2, activation="swiglu_oai", biases=True,
         config=MoeGemmConfig(block_m=16, block_n=256, block_k=16)),
    # a resident bank's planar MXFP4: several groups of 16 rows a tile and tiles of one group; beside other formats
    Case((QType.MXFP4,) * 3, num_tokens=10, hidden=224, ff=160, top_k=2, activation="swiglu_oai", biases=True,
         config=MoeGemmConfig(block_m=16, block_n=32, block_k=32), planar=True),
    Case((QType.Q4_0, QType.MXFP4, QType.Q8_0), num_tokens=7, top_k=3, config=MoeGemmConfig(block_m=16, block_n=16),
         planar=True),
]
CPU = torch.device("cpu")
INTERPRETER_CHECKS = [(f"{'-'.join(q.name for q in c.types)} tokens={c.num_tokens} top_k={c.top_k} {c.activation}"
                       f"{' biases' if c.biases else ''}{' planar' if c.planar else ''}",
                       lambda seed, c=c: run_case(c, CPU, seed))
                      for c in INTERPRETER_CASES]
INTERPRETER_CHECKS.append(("deterministic, all skipped",
                           lambda seed: check_deterministic_and_empty(INTERPRETER_CASES[5], CPU, seed)))
INTERPRETER_CHECKS.append(("token-major pairs", lambda seed: check_token_major_pairs(INTERPRETER_CASES[0], CPU, seed)))
INTERPRETER_CHECKS.append(("experts where they are",
                           lambda seed: check_experts_where_they_are(INTERPRETER_CASES[3], CPU, seed)))


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS, timeout=900)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
