"""The Triton grouped expert FFN (`ops.triton`) against the torch reference `expert_ffn_reference`.

Fresh random inputs every run: valid random GGUF blocks, routing with experts shared by several
tokens, a token holding the same expert twice, skipped pairs (-1) and a shuffled pair order. The
output buffer is poisoned with NaN before each run, and so is the memory the kernels' intermediate
buffers come from (a read of a skipped pair's row would surface as NaN).

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA, the same checks run on tiny shapes under
Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles
anything, and must not reach the other tests of this process).
"""

from __future__ import annotations

import os
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

from ops.triton import ExpertTables, LaunchConfig, expert_ffn_triton, grouped_expert_ffn, tables_from_bank  # noqa: E402
from ops.triton.experts import gate_format  # noqa: E402
from ops.triton.pairs import MAX_WINDOW, window_for  # noqa: E402
from ops.triton.prepare import Prepared, launch_prepare  # noqa: E402
from ops.triton.qdot import INT8_CAPABLE, _int8_types, reads_int8  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

# ||out - ref|| / ||ref|| over the whole output. The kernels compute in float32 on exactly the
# activations the reference sees (bf16 widens exactly), so only summation order differs: measured
# ~5e-7. A wrong scale, min, bit plane or skipped pair gives errors of order 1e-2 to 1.
RTOL = 1e-5
# formats that read x as two int8 planes (`ops.triton.qdot.INT8_TYPES`) round x and h to 1/(2 * 127 * 256) of each
# block's max: measured 2-5e-5, the CPU kernels' bound on the same form (tests/ops/test_cpu_experts.py)
INT8_RTOL = 3e-4

# gate, up, down types: the six kernel formats, the Q4_K_M layout (Q6_K down), mixes of the kernels, and formats
# without a kernel (gather + dequantize path, also mixed with a kernel)
FORMATS = [
    (QType.Q4_K, QType.Q4_K, QType.Q4_K),
    (QType.Q5_K, QType.Q5_K, QType.Q5_K),
    (QType.Q6_K, QType.Q6_K, QType.Q6_K),
    (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    (QType.Q4_0, QType.Q4_0, QType.Q4_0),
    (QType.MXFP4, QType.MXFP4, QType.MXFP4),
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    (QType.Q5_K, QType.Q8_0, QType.Q4_K),
    (QType.Q4_0, QType.MXFP4, QType.Q8_0),
    (QType.MXFP4, QType.MXFP4, QType.Q4_0),
    (QType.IQ4_XS, QType.F16, QType.Q8_0),
]
# what an expert computes between its matrices (`ops.expert_math`): activation, with biases or not
MATHS = [("silu", True), ("gelu", False), ("gelu", True), ("swiglu_oai", True), ("swiglu_oai", False)]


@dataclass(frozen=True)
class Case:
    types: tuple[QType, QType, QType]
    num_tokens: int
    dtype: torch.dtype = torch.float32
    hidden: int = 512
    ff: int = 256
    num_experts: int = 8
    top_k: int = 4
    block_tokens: int | None = None
    gate_up_rows: int = 16  # rows per program
    down_rows: int = 32
    activation: str = "silu"
    biases: bool = False
    blocks: int = 0  # blocks of 32 a step of the 32-block formats (0: by the row)
    spread: bool = True  # an expert's passes in programs side by side (`LaunchConfig.spread`)
    planar: bool = False  # the device bank's MXFP4 matrices in `ops.bank.to_planar`'s order (a resident bank's)


def random_math(case: Case, generator: torch.Generator) -> ExpertMath:
    """The case's activation, with random biases of about the projections' size (0.5 x randn) if it has them: a
    bias dropped, or added after the routing weight, moves the output by far more than RTOL."""
    def bias(cols: int) -> torch.Tensor | None:
        return 0.5 * torch.randn(case.num_experts, cols, generator=generator) if case.biases else None

    return ExpertMath(case.activation, bias(case.ff), bias(case.ff), bias(case.hidden))  # type: ignore[arg-type]


def random_bank(case: Case, generator: torch.Generator) -> ExpertWeights:
    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, case.num_experts * rows * blocks, generator).view(case.num_experts, rows, -1)

    gate_type, up_type, down_type = case.types
    return ExpertWeights(
        projection(gate_type, case.ff, case.hidden), projection(up_type, case.ff, case.hidden),
        projection(down_type, case.hidden, case.ff), gate_type, up_type, down_type, case.hidden, case.ff,
        random_math(case, generator))


def on_device(bank: ExpertWeights, device: torch.device, pin: bool = False) -> ExpertWeights:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if pin else t.to(device)

    return ExpertWeights(move(bank.gate), move(bank.up), move(bank.down), bank.gate_type, bank.up_type,
                         bank.down_type, bank.hidden, bank.ff, bank.math)


def random_routing(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_ids, expert_ids, weights (CPU): top_k distinct experts per token, one extra pair that
    repeats a (token, expert), about 1 in 6 pairs skipped, pairs shuffled."""
    scores = torch.rand(case.num_tokens, case.num_experts, generator=generator)
    expert_ids = scores.topk(case.top_k, dim=1).indices.reshape(-1)
    token_ids = torch.arange(case.num_tokens).repeat_interleave(case.top_k)
    token_ids, expert_ids = torch.cat([token_ids, token_ids[:1]]), torch.cat([expert_ids, expert_ids[:1]])
    is_skipped = torch.rand(expert_ids.shape, generator=generator) < 1 / 6
    expert_ids = torch.where(is_skipped, -1, expert_ids)
    order = torch.randperm(expert_ids.shape[0], generator=generator)
    weights = torch.rand(expert_ids.shape, generator=generator)
    return token_ids[order], expert_ids[order], weights[order]


def poison_allocator(device: torch.device, num_bytes: int) -> None:
    """Leave NaN in the memory the next allocations of this size will get (CUDA caching allocator)."""
    if device.type == "cuda":
        torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(float("nan"))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


def run_case(case: Case, device: torch.device, seed: int) -> float:
    """Kernel output vs the reference for fresh random inputs; asserts and returns the relative error."""
    generator = torch.Generator().manual_seed(seed)
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = random_routing(case, generator)
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(case.dtype)
    ref = expert_ffn_reference(x, token_ids, expert_ids, weights, bank)
    device_bank = on_device(bank, device)  # NOTE: tables hold raw addresses; the bank must stay alive
    device_bank = to_planar(device_bank) if case.planar else device_bank
    tables = tables_from_bank(device_bank, device)
    assert tables.planar == (case.planar and QType.MXFP4 in case.types)
    out = torch.full((case.num_tokens, case.hidden), float("nan"), device=device)
    poison_allocator(device, 64 << 20)
    grouped_expert_ffn(x.to(device), token_ids.to(device), expert_ids.to(device), weights.to(device), tables,
                       out=out, config=LaunchConfig(case.gate_up_rows, case.down_rows, case.block_tokens, case.blocks,
                                                         case.spread))
    assert out.isfinite().all(), "unwritten or non-finite outputs"
    error = relative_error(out, ref)
    assert error < tolerance(case), f"{case}: relative error {error:.2e}"
    return error


def tolerance(case: Case) -> float:
    return INT8_RTOL if any(reads_int8(t) for t in case.types) else RTOL


def check_16bit_out(case: Case, device: torch.device, seed: int) -> None:
    """An `out` of the activations' 16-bit dtype holds the float32 result rounded once (the combine
    kernel stores its float32 sum in out's dtype): to nearest even on CUDA, as torch rounds; within
    one unit in the last place under the interpreter (its conversion may round differently)."""
    generator = torch.Generator().manual_seed(seed)
    device_bank = on_device(random_bank(case, generator), device)
    token_ids, expert_ids, weights = (t.to(device) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(case.dtype).to(device)
    tables = tables_from_bank(device_bank, device)
    wide = grouped_expert_ffn(x, token_ids, expert_ids, weights, tables)
    narrow = torch.full(wide.shape, float("nan"), dtype=case.dtype, device=device)
    grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, out=narrow)
    assert wide.dtype == torch.float32 and narrow.isfinite().all()
    ulp = torch.finfo(case.dtype).eps * wide.abs()
    assert ((narrow.float() - wide).abs() <= ulp).all()
    if device.type == "cuda":
        assert torch.equal(narrow, wide.to(case.dtype))


def check_int8_planes(device: torch.device, seed: int) -> None:
    """x prepared for an int8 format (`ops.triton.prepare`'s layout) holds, per block of 32, d = max |x| / 127 and
    two planes in [-127, 127] with x - d (q0 + q1 / 256) within one step of the finer grid (half a step, or a
    residual of d / 2 clamped from 128 to 127); its sums per 16 are the planes' values summed. A zero block gives
    d = 0 and zero codes."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = 3, 1280  # two programs a row, the second one partly past the row
    x = torch.randn(rows, cols, generator=generator) * torch.rand(rows, cols // 32, 1, generator=generator).mul(
        8).exp().repeat(1, 1, 32).view(rows, cols)
    x[0, 64:96] = 0.0
    x[1, 7] = 1e4  # an outlier: its block's other values keep the finer grid's absolute error
    prepared, sums = launch_prepare(x.to(device), QType.Q4_K)
    raw = prepared.cpu().view(torch.int8).view(rows, 4 * cols)
    q0, q1 = raw[:, :cols].float(), raw[:, cols:2 * cols].float()
    d = prepared.cpu()[:, cols // 2:cols // 2 + cols // 32]
    blocks = x.view(rows, cols // 32, 32)
    torch.testing.assert_close(d, blocks.abs().amax(dim=2) / 127, rtol=1e-6, atol=0)
    assert q0.abs().max() <= 127 and q1.abs().max() <= 127
    values = (d.repeat_interleave(32, dim=1) * (q0 + q1 / 256))
    step = d.repeat_interleave(32, dim=1) / 256
    assert ((values - x).abs() <= step * (1 + 1e-5)).all()
    assert (q0[0, 64:96] == 0).all() and (q1[0, 64:96] == 0).all() and d[0, 2] == 0
    torch.testing.assert_close(sums.cpu(), values.view(rows, cols // 16, 16).sum(dim=2), rtol=1e-5, atol=1e-3)


def check_prepared_x(case: Case, device: torch.device, seed: int) -> None:
    """x prepared elsewhere for the gate format (as `assign_experts` does in a cached decode step) gives the same
    bits as the launch preparing it; x prepared for another format is refused."""
    generator = torch.Generator().manual_seed(seed)
    device_bank = on_device(random_bank(case, generator), device)
    token_ids, expert_ids, weights = (t.to(device) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(case.dtype).to(device)
    tables = tables_from_bank(device_bank, device)
    qtype = gate_format(tables)
    assert qtype == case.types[0]
    prepared = Prepared(*launch_prepare(x, qtype), qtype)
    alone = grouped_expert_ffn(x, token_ids, expert_ids, weights, tables)
    assert torch.equal(grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, prepared=prepared), alone)
    other = QType.Q8_0 if qtype != QType.Q8_0 else QType.Q4_K
    with pytest.raises(ValueError, match="prepared"):
        grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, prepared=replace(prepared, qtype=other))


# --- CUDA -----------------------------------------------------------------------------------------


CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_matches_reference(types: tuple[QType, QType, QType], dtype: torch.dtype) -> None:
    run_case(Case(types, num_tokens=5, dtype=dtype), CUDA, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("math", MATHS, ids=lambda m: f"{m[0]}{'-biases' if m[1] else ''}")
@pytest.mark.parametrize("types", [(QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q4_0,) * 3, (QType.MXFP4,) * 3],
                         ids=lambda t: "-".join(q.name for q in t))
def test_every_expert_math_in_the_kernels(types: tuple[QType, QType, QType], math: tuple[str, bool]) -> None:
    run_case(Case(types, num_tokens=5, dtype=torch.bfloat16, activation=math[0], biases=math[1]), CUDA,
             seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2816, 704, QType.Q4_0, "gelu", False),
                                   (2880, 2880, QType.MXFP4, "swiglu_oai", True)],
                         ids=["gemma4-26b-a4b", "gpt-oss-20b"])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_the_new_presets_shapes(shape: tuple[int, int, QType, str, bool], num_tokens: int) -> None:
    hidden, ff, qtype, activation, biases = shape
    case = Case((qtype,) * 3, num_tokens, torch.bfloat16, hidden=hidden, ff=ff, num_experts=16, top_k=4,
                activation=activation, biases=biases)
    run_case(case, CUDA, seed=int(torch.randint(1 << 30, ())))
    if qtype == QType.MXFP4:  # as a resident layer holds it
        run_case(replace(case, planar=True), CUDA, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("types", [(QType.Q8_0,) * 3, (QType.Q4_0,) * 3, (QType.MXFP4,) * 3,
                                   (QType.Q4_0, QType.MXFP4, QType.Q8_0)], ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("blocks", [8, 16])
@pytest.mark.parametrize("shape", [(2816, 704), (2880, 2880), (224, 160)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_more_blocks_a_step(types: tuple[QType, QType, QType], blocks: int, shape: tuple[int, int]) -> None:
    # rows of 88, 90, 22, 7 and 5 blocks: every one but 88 at 8 ends in a step that reaches past the row
    case = Case(types, 3, torch.bfloat16, hidden=shape[0], ff=shape[1], num_experts=8, top_k=4, biases=True,
                blocks=blocks)
    run_case(case, CUDA, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 17, 32])
def test_token_counts(num_tokens: int) -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens, torch.bfloat16, hidden=1024, ff=512,
                num_experts=16, top_k=8)
    run_case(case, CUDA, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
@pytest.mark.parametrize("block_tokens", [1, 2, 4])
@pytest.mark.parametrize("spread", [True, False])
def test_experts_shared_by_many_tokens(block_tokens: int, spread: bool) -> None:
    # 32 tokens on 6 experts: groups of ~20 pairs, several passes of block_tokens pairs each, side by side or not
    case = Case((QType.Q4_K,) * 3, 32, num_experts=6, top_k=4, block_tokens=block_tokens, spread=spread)
    run_case(case, CUDA, seed=int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
def test_pinned_host_bank_reads_the_same_bits() -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=3)
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = (t.to(CUDA) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(CUDA)
    in_vram = expert_ffn_triton(x, token_ids, expert_ids, weights, on_device(bank, CUDA))
    host = on_device(bank, CUDA, pin=True)
    assert host.gate.device.type == "cpu" and host.gate.is_pinned()
    zero_copy = expert_ffn_triton(x, token_ids, expert_ids, weights, host)
    assert torch.equal(in_vram, zero_copy)
    ref = expert_ffn_reference(x.cpu(), token_ids.cpu(), expert_ids.cpu(), weights.cpu(), bank)
    assert relative_error(zero_copy, ref) < tolerance(case)


@pytest.mark.gpu
def test_16bit_out_is_the_rounded_float32_result() -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=4, dtype=torch.bfloat16)
    check_16bit_out(case, CUDA, int(torch.randint(1 << 30, ())))


@pytest.mark.gpu
def test_int8_planes() -> None:
    check_int8_planes(CUDA, seed=0)


@pytest.mark.gpu
def test_x_prepared_elsewhere_reads_the_same_bits() -> None:
    for seed, types in enumerate(FORMATS[:6]):
        check_prepared_x(Case(types, num_tokens=3, dtype=torch.bfloat16), CUDA, seed)


@pytest.mark.gpu
def test_deterministic() -> None:
    case = Case((QType.Q4_K,) * 3, num_tokens=16, num_experts=4)
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    device_bank = on_device(random_bank(case, generator), CUDA)
    token_ids, expert_ids, weights = (t.to(CUDA) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(CUDA)
    first = expert_ffn_triton(x, token_ids, expert_ids, weights, device_bank)
    assert all(torch.equal(first, expert_ffn_triton(x, token_ids, expert_ids, weights, device_bank))
               for _ in range(3))


@pytest.mark.gpu
def test_null_pointers_and_bad_ids_are_skipped() -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q8_0), num_tokens=6)
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = random_routing(case, generator)
    device_bank = on_device(bank, CUDA)
    tables = tables_from_bank(device_bank, CUDA)
    no_down = tables.down_ptrs.clone()
    no_down[3] = 0  # expert 3 not placed anywhere
    tables = ExpertTables(tables.gate_ptrs, tables.up_ptrs, no_down, *case.types, case.hidden, case.ff)
    expert_ids[:2] = torch.tensor([case.num_experts, -7])  # out of range either way
    kept = torch.where((expert_ids == 3) | (expert_ids >= case.num_experts) | (expert_ids < 0), -1, expert_ids)
    x = torch.randn(case.num_tokens, case.hidden, generator=generator)
    ref = expert_ffn_reference(x, token_ids, kept, weights, bank)
    poison_allocator(CUDA, 64 << 20)
    out = grouped_expert_ffn(x.to(CUDA), token_ids.to(CUDA), expert_ids.to(CUDA), weights.to(CUDA), tables)
    assert out.isfinite().all()
    assert relative_error(out, ref) < tolerance(case)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_routing() -> None:
    case = Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=4)
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    bank = random_bank(case, generator)
    device_bank = on_device(bank, CUDA)
    tables = tables_from_bank(device_bank, CUDA)
    token_ids, expert_ids, weights = (t.to(CUDA) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, generator=generator).to(CUDA)
    out = torch.empty(case.num_tokens, case.hidden, device=CUDA)
    grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, out=out)
    for _ in range(2):
        new_tokens, new_experts, new_weights = random_routing(case, generator)
        token_ids.copy_(new_tokens), expert_ids.copy_(new_experts), weights.copy_(new_weights)
        x.copy_(torch.randn(case.num_tokens, case.hidden, generator=generator))
        out.fill_(float("nan"))
        graph.replay()
        ref = expert_ffn_reference(x.cpu(), new_tokens, new_experts, new_weights, bank)
        assert relative_error(out, ref) < tolerance(case)


@pytest.mark.gpu
def test_launcher_rejects_bad_inputs() -> None:
    case = Case((QType.Q4_K,) * 3, num_tokens=2)
    generator = torch.Generator().manual_seed(0)
    device_bank = on_device(random_bank(case, generator), CUDA)
    token_ids, expert_ids, weights = (t.to(CUDA) for t in random_routing(case, generator))
    x = torch.randn(case.num_tokens, case.hidden, device=CUDA)
    with pytest.raises(ValueError, match="x"):
        expert_ffn_triton(x[:, :-16], token_ids, expert_ids, weights, device_bank)
    with pytest.raises(ValueError, match="expert_ids"):
        expert_ffn_triton(x, token_ids, expert_ids.float(), weights, device_bank)
    with pytest.raises(ValueError, match="weights"):
        expert_ffn_triton(x, token_ids, expert_ids, weights[:-1], device_bank)
    host = random_bank(case, generator)  # pageable host memory: not readable by the GPU
    with pytest.raises(ValueError, match="cannot be read"):
        expert_ffn_triton(x, token_ids, expert_ids, weights, host)


# --- anywhere -----------------------------------------------------------------------------------------


def test_tables_reject_bad_pointer_tables() -> None:
    good = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        ExpertTables(good.int(), good, good, QType.Q4_K, QType.Q4_K, QType.Q4_K, 256, 256)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertTables(good, good[:3], good, QType.Q4_K, QType.Q4_K, QType.Q4_K, 256, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        ExpertTables(good, good, good, QType.Q4_K, QType.Q4_K, QType.Q4_K, 256, 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on CPU tensors")
def test_cpu_tensors_need_cuda_or_the_interpreter() -> None:
    case = Case((QType.Q4_K,) * 3, num_tokens=1, hidden=256, ff=256, num_experts=2, top_k=1)
    generator = torch.Generator().manual_seed(0)
    bank = random_bank(case, generator)
    token_ids, expert_ids, weights = random_routing(case, generator)
    with pytest.raises(ValueError, match="CUDA"):
        expert_ffn_triton(torch.randn(1, 256), token_ids, expert_ids, weights, bank)


# --- the interpreter (no CUDA) ------------------------------------------------------------------------

# tiny shapes and few, large programs: the interpreter runs each program in numpy
INTERPRETER_CASES = [
    Case((QType.Q4_K,) * 3, num_tokens=3, hidden=256, ff=256, num_experts=4, top_k=2, gate_up_rows=32),
    Case((QType.Q5_K, QType.Q4_K, QType.Q6_K), num_tokens=2, dtype=torch.bfloat16, hidden=256, ff=256,
         num_experts=4, top_k=2, gate_up_rows=32),
    Case((QType.Q8_0,) * 3, num_tokens=3, hidden=256, ff=256, num_experts=4, top_k=2, gate_up_rows=32),
    Case((QType.Q5_K,) * 3, num_tokens=3, hidden=512, ff=256, num_experts=4, top_k=2, gate_up_rows=32),
    Case((QType.Q4_K,) * 3, num_tokens=4, hidden=256, ff=256, num_experts=2, top_k=2, block_tokens=4,
         gate_up_rows=32),
    # groups of 5 pairs in passes of 2: programs side by side (ranks 0, 2, 4), or the first pair's program alone
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=5, hidden=256, ff=256, num_experts=2, top_k=2,
         block_tokens=2, gate_up_rows=32),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=5, hidden=256, ff=256, num_experts=2, top_k=2,
         block_tokens=2, gate_up_rows=32, spread=False),
    Case((QType.IQ4_XS, QType.F16, QType.Q8_0), num_tokens=2, hidden=256, ff=256, num_experts=3, top_k=2,
         gate_up_rows=32),
    # rows of 32-blocks not a multiple of 256 (Gemma 4's 704, gpt-oss's 2880), and every expert math
    Case((QType.Q4_0,) * 3, num_tokens=3, hidden=224, ff=160, num_experts=4, top_k=2, gate_up_rows=32,
         activation="gelu"),
    Case((QType.MXFP4,) * 3, num_tokens=3, hidden=224, ff=160, num_experts=4, top_k=2, gate_up_rows=32,
         activation="swiglu_oai", biases=True),
    Case((QType.Q4_0, QType.MXFP4, QType.Q8_0), num_tokens=2, dtype=torch.bfloat16, hidden=256, ff=192,
         num_experts=4, top_k=2, gate_up_rows=32, biases=True),
    Case((QType.Q4_K, QType.Q4_K, QType.Q6_K), num_tokens=2, hidden=256, ff=256, num_experts=3, top_k=2,
         gate_up_rows=32, activation="gelu", biases=True),
    # 16 blocks a step over rows of 24 and 5 blocks: the last step reaches past the row
    Case((QType.Q4_0, QType.MXFP4, QType.Q8_0), num_tokens=2, hidden=768, ff=160, num_experts=3, top_k=2,
         gate_up_rows=32, biases=True, blocks=16),
    # a resident bank's planar MXFP4: programs over several groups of 16 rows and within one, rows past a step
    Case((QType.MXFP4,) * 3, num_tokens=3, hidden=224, ff=160, num_experts=4, top_k=2, gate_up_rows=32,
         down_rows=16, activation="swiglu_oai", biases=True, planar=True),
    Case((QType.Q4_0, QType.MXFP4, QType.Q8_0), num_tokens=2, hidden=768, ff=160, num_experts=3, top_k=2,
         gate_up_rows=16, biases=True, blocks=16, planar=True),
]
INTERPRETER_CHECKS = [(f"{'-'.join(q.name for q in c.types)} tokens={c.num_tokens} {c.activation}"
                       f"{' biases' if c.biases else ''}{f' blocks={c.blocks}' if c.blocks else ''}"
                       f"{f' bt={c.block_tokens}' if c.block_tokens else ''}{'' if c.spread else ' not spread'}"
                       f"{' planar' if c.planar else ''}",
                       lambda seed, c=c: run_case(c, torch.device("cpu"), seed)) for c in INTERPRETER_CASES]
INTERPRETER_CHECKS.append(("bf16 out", lambda seed: check_16bit_out(INTERPRETER_CASES[1], torch.device("cpu"), seed)))
INTERPRETER_CHECKS.append(("int8 planes", lambda seed: check_int8_planes(torch.device("cpu"), seed)))
INTERPRETER_CHECKS.append(("prepared x",
                           lambda seed: check_prepared_x(INTERPRETER_CASES[1], torch.device("cpu"), seed)))


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS, timeout=900)


def test_a_pair_is_its_own_window_only_where_nothing_is_shared_or_copied() -> None:
    assert window_for(8, 1, spread=True, fills=False) == 1  # a resident batch-1 step: no scan
    assert window_for(8, 2, spread=True, fills=False) == 8  # pairs of an expert computed together: their group
    assert window_for(8, 1, spread=False, fills=False) == 8  # the group's first pair computes it all
    assert window_for(8, 1, spread=True, fills=True) == 8  # a streamed expert is copied by one program
    assert window_for(1000) == MAX_WINDOW and window_for(3) == 4


def test_the_int8_formats_are_named_by_the_environment() -> None:
    assert _int8_types("Q4_K") == (QType.Q4_K,)
    assert _int8_types("Q4_K, Q8_0,Q4_0") == (QType.Q4_K, QType.Q8_0, QType.Q4_0)
    assert _int8_types("0") == () and _int8_types("") == ()
    with pytest.raises(ValueError, match="Q6_K"):
        _int8_types("Q4_K,Q6_K")


@needs_no_cuda
def test_every_int8_kernel_under_the_interpreter() -> None:
    """The same checks with every format that has an int8 kernel reading x as int8 planes (`qdot.INT8_CAPABLE`,
    chosen by MOECACHE_INT8_EXPERTS at import), not only the default ones."""
    run_interpreted(__file__, INTERPRETER_CHECKS, timeout=900,
                    MOECACHE_INT8_EXPERTS=",".join(t.name for t in INT8_CAPABLE))


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
