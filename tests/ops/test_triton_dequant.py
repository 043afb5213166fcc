"""`ops.triton.dequant.dequantize_rows` against the torch reference `ops.quants`, bit for bit.

Fresh random blocks every run (valid GGUF blocks; their fp16 scales include subnormals). The kernels
must give exactly `QuantFormat.dequantize_blocks(...).to(dtype)`: the float32 weights of the reference,
rounded once. Output buffers are poisoned with NaN, so an unwritten weight shows.

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA, the same checks run on small shapes under
Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles
anything, and must not reach the other tests of this process).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ops import quants
from ops.cpu_experts import QType

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU dequantize kernels need it")

from ops.triton.dequant import dequantize_rows  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

KERNEL_FORMATS = [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0]
FALLBACK_FORMATS = [QType.IQ4_XS, QType.Q4_0]  # no kernel: the torch reference and a cast
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def random_rows(qtype: QType, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 `[rows, row_bytes]` of valid random blocks, on the generator's device."""
    fmt = quants.format_of(qtype)
    return fmt.random_blocks(rows * cols // fmt.block_size, generator, 0.02).view(rows, -1)


def reference(raw: torch.Tensor, qtype: QType, cols: int, dtype: torch.dtype) -> torch.Tensor:
    fmt = quants.format_of(qtype)
    return fmt.dequantize_blocks(raw.reshape(-1, fmt.type_size)).view(raw.shape[0], cols).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of floats (torch.equal would take -0.0 for 0.0)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    differ = bits(out.cpu()) != bits(ref.cpu())
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.numel()} weights differ"


def run_case(qtype: QType, rows: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int,
             use_out: bool = False) -> None:
    generator = torch.Generator().manual_seed(seed)
    raw = random_rows(qtype, rows, cols, generator)
    ref = reference(raw, qtype, cols, dtype)
    out = torch.full((rows, cols), float("nan"), dtype=dtype, device=device) if use_out else None
    result = dequantize_rows(raw.to(device), qtype, cols, out=out, dtype=dtype)
    assert out is None or result is out
    assert_same_bits(result, ref, f"{qtype.name} {dtype} [{rows}, {cols}]")


def fresh_seed() -> int:
    return int(torch.randint(1 << 30, ()))


# --- CUDA -----------------------------------------------------------------------------------------


CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qtype", KERNEL_FORMATS + FALLBACK_FORMATS[:1], ids=lambda q: q.name)
def test_matches_reference(qtype: QType, dtype: torch.dtype) -> None:
    run_case(qtype, 96, 2048, dtype, CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 33, 101])
@pytest.mark.parametrize("qtype", KERNEL_FORMATS, ids=lambda q: q.name)
def test_odd_row_counts(qtype: QType, rows: int) -> None:
    # 3 super-blocks a row: the last program of a launch is partly past the end
    run_case(qtype, rows, 768, torch.bfloat16, CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qtype", KERNEL_FORMATS + FALLBACK_FORMATS, ids=lambda q: q.name)
def test_writes_into_out(qtype: QType, dtype: torch.dtype) -> None:
    run_case(qtype, 17, 1024, dtype, CUDA, fresh_seed(), use_out=True)


@pytest.mark.gpu
def test_a_layer_of_experts() -> None:
    # 128 experts x 768 rows of 2048: 201M weights, the prefill shape; the reference runs on the GPU
    generator = torch.Generator(CUDA).manual_seed(fresh_seed())
    raw = random_rows(QType.Q4_K, 128 * 768, 2048, generator)
    assert_same_bits(dequantize_rows(raw, QType.Q4_K, 2048), reference(raw, QType.Q4_K, 2048, torch.bfloat16),
                     "Q4_K layer")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", KERNEL_FORMATS, ids=lambda q: q.name)
def test_cuda_graph_replay_reads_new_bytes(qtype: QType) -> None:
    generator = torch.Generator().manual_seed(fresh_seed())
    raw = random_rows(qtype, 24, 512, generator).to(CUDA)
    out = torch.empty(24, 512, dtype=torch.bfloat16, device=CUDA)
    dequantize_rows(raw, qtype, 512, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dequantize_rows(raw, qtype, 512, out=out)
    for _ in range(2):
        new = random_rows(qtype, 24, 512, generator)
        raw.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        assert_same_bits(out, reference(new, qtype, 512, torch.bfloat16), f"{qtype.name} replay")


# --- anywhere -----------------------------------------------------------------------------------------


def test_rejects_bad_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    device = CUDA if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the CUDA check; nothing here launches
    raw = random_rows(QType.Q4_K, 4, 512, torch.Generator().manual_seed(0)).to(device)
    with pytest.raises(ValueError, match="raw: expected contiguous 2-D uint8"):
        dequantize_rows(raw.view(torch.int8), QType.Q4_K, 512)
    with pytest.raises(ValueError, match="raw: expected contiguous 2-D uint8"):
        dequantize_rows(raw.view(-1), QType.Q4_K, 512)
    with pytest.raises(ValueError, match="raw: expected contiguous 2-D uint8"):
        dequantize_rows(torch.cat([raw, raw], dim=1)[:, :288], QType.Q4_K, 512)
    with pytest.raises(ValueError, match="take 288 bytes, got 144"):
        dequantize_rows(raw[:, :144].contiguous(), QType.Q4_K, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize_rows(raw, QType.Q4_K, 500)
    with pytest.raises(ValueError, match="unsupported tensor type IQ2_XXS"):
        dequantize_rows(raw, QType.IQ2_XXS, 512)
    with pytest.raises(ValueError, match="dtype"):
        dequantize_rows(raw, QType.Q4_K, 512, dtype=torch.int32)
    for bad in (torch.empty(4, 256, dtype=torch.bfloat16), torch.empty(4, 512, dtype=torch.float16),
                torch.empty(512, 4, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out: expected contiguous"):
            dequantize_rows(raw, QType.Q4_K, 512, out=bad.to(device))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on CPU tensors")
def test_cpu_tensors_need_cuda_or_the_interpreter() -> None:
    raw = random_rows(QType.Q4_K, 2, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="CUDA"):
        dequantize_rows(raw, QType.Q4_K, 256)


# --- the interpreter (no CUDA) ------------------------------------------------------------------------

# 7 rows of 1280: 35 super-blocks or 280 Q8_0 blocks, several programs, the last one partly past the end
INTERPRETER_CASES = [(qtype, dtype, dtype == torch.float16) for qtype in KERNEL_FORMATS for dtype in DTYPES]
INTERPRETER_CASES += [(qtype, torch.bfloat16, True) for qtype in FALLBACK_FORMATS]
INTERPRETER_CHECKS = [(f"{qtype.name} {dtype} out={use_out}",
                       lambda seed, q=qtype, d=dtype, o=use_out: run_case(q, 7, 1280, d, torch.device("cpu"), seed, o))
                      for qtype, dtype, use_out in INTERPRETER_CASES]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
