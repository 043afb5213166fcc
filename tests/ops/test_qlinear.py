"""Dense matrices kept as Q8_0 (`ops.qweight.Q8Weight`) and their product (`ops.fused.linear`, the Triton kernel
`ops.triton.qlinear`): the repacked codes and scales against gguf-py's dequantization, the kernel against the
matrix dequantized and rounded to bf16 (the values it multiplies), and the torch path off CUDA. The CUDA tests
(`@pytest.mark.gpu`) run Qwen3-30B-A3B's attention shapes; without CUDA the kernel runs under Triton's interpreter in
a subprocess (tests/ops/interpreter.py)."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ops import quants
from ops.fused import linear
from ops.quants import QType
from ops.qweight import Q8Weight

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU kernels need it")

from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

# ||y - ref|| / ||ref||: the kernel multiplies the same bf16 weights as the reference in float32, in another order,
# and rounds y to x's dtype (bf16: 2**-9). A wrong scale, code or row gives > 0.1.
RTOL = 1e-2


def random_q8(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    return quants.random_blocks(QType.Q8_0, n * k // 32, generator).view(n, k // 32 * 34)


def test_repacked_matrix_is_gguf_py_dequantized() -> None:
    generator = torch.Generator().manual_seed(0)
    raw = random_q8(24, 96, generator)
    w = Q8Weight.from_gguf(raw, (24, 96), torch.device("cpu"))
    expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(w.dequantize().numpy(), expected.astype(np.float32))
    assert w.nbytes == raw.numel()


def test_wrong_sizes_are_refused() -> None:
    raw = random_q8(4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="expected 272 bytes"):
        Q8Weight.from_gguf(raw[:, :-34], (4, 64), torch.device("cpu"))
    with pytest.raises(ValueError, match="blocks of 32"):
        Q8Weight.from_gguf(raw, (4, 68), torch.device("cpu"))


def test_linear_off_cuda_is_the_dequantized_product() -> None:
    generator = torch.Generator().manual_seed(1)
    w = Q8Weight.from_gguf(random_q8(8, 64, generator), (8, 64), torch.device("cpu"))
    x, bias = torch.randn(3, 64, generator=generator), torch.randn(8, generator=generator)
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w.dequantize(), bias))
    dense = torch.randn(8, 64, generator=generator)
    torch.testing.assert_close(linear(x, dense), x @ dense.T)


def test_a_decode_step_splits_k_where_w_has_few_rows() -> None:
    from ops.triton.qlinear import default_config

    assert default_config(1, 2048, 4096).splits > 1  # an o projection: 64 programs of 32 rows
    assert default_config(1, 151936, 2048).splits == 1  # the output matrix: thousands
    assert default_config(512, 2048, 4096).splits == 1  # a prompt: enough tiles of x
    assert default_config(3, 40, 1024).splits == 2  # the interpreter's cases below
    assert default_config(2, 100, 4096).splits == 8


def run_case(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: torch.device, seed: int) -> float:
    generator = torch.Generator(device=device).manual_seed(seed)
    w = Q8Weight.from_gguf(random_q8(n, k, generator), (n, k), device)
    x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
    b = torch.randn(n, generator=generator, device=device) * 0.1 if bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = F.linear(x.float(), w.dequantize(torch.bfloat16).float(), b)
    error = ((y.float() - ref).norm() / ref.norm()).item()
    assert error < RTOL, f"rows={rows} n={n} k={k} bias={bias} {dtype}: relative error {error:.2e}"
    wrong = F.linear(x.float(), w.dequantize(torch.bfloat16).float().roll(1, 0), b)  # rows off by one
    assert ((wrong - ref).norm() / ref.norm()).item() > 10 * RTOL
    return error


# rows: a decode step's few and a prompt's many (tiles of 16 and 64, a partial one); n not a multiple of the tile; k
# with 32- to 256-column steps, and split in parts
CASES = [(1, 48, 96, False, torch.bfloat16), (5, 40, 128, True, torch.bfloat16), (17, 72, 64, False, torch.float32),
         (70, 36, 256, True, torch.bfloat16), (3, 40, 1024, True, torch.bfloat16)]  # the last in two parts of K


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 512])
@pytest.mark.parametrize("shape", [(5120, 2048), (2048, 4096)], ids=["qkv", "o"])
def test_kernel_on_qwen3_shapes(rows: int, shape: tuple[int, int]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_case(rows, *shape, False, torch.bfloat16, torch.device("cuda"), rows)


def split_products_repeat(device: torch.device, seed: int) -> float:
    """A product split in 8 parts of K over 4 tiles of W, twice: the same bits each time (the parts are added in part
    order by the last to arrive), and the arrival counters left at zero for the next product."""
    from ops.triton.qlinear import _COUNTERS, default_config

    assert default_config(2, 100, 4096).splits == 8
    error = run_case(2, 100, 4096, True, torch.bfloat16, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    w = Q8Weight.from_gguf(random_q8(100, 4096, generator), (100, 4096), device)
    x = torch.randn(2, 4096, generator=generator, device=device).to(torch.bfloat16)
    first = linear(x, w)
    assert torch.equal(linear(x, w), first)
    assert int(_COUNTERS[first.device].abs().sum()) == 0
    return error


@pytest.mark.gpu
def test_split_products_repeat_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    split_products_repeat(torch.device("cuda"), 3)


CPU = torch.device("cpu")
INTERPRETER_CHECKS = [(f"rows={c[0]} n={c[1]} k={c[2]} bias={c[3]} {c[4]}", lambda seed, c=c: run_case(*c, CPU, seed))
                      for c in CASES] + [("split in 8, twice", lambda seed: split_products_repeat(CPU, seed))]


@needs_no_cuda
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
