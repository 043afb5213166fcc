from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import quants
from ops.quants import QType

ALL_TYPES = [
    QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4,
]  # fmt: skip
FLOAT_TYPES = [QType.F32, QType.F16, QType.BF16]
# relative RMS error of a round trip on Gaussian weights; measured on 16M weights: Q8_0 0.535%,
# Q6_K 1.77%, Q5_K 3.62%, Q4_K 7.18% (a scalar port of llama.cpp's *_ref quantizers: 1.78%, 3.63%, 7.14%),
# Q4_0 8.59%
ROUND_TRIP_BOUNDS = {QType.Q8_0: 0.006, QType.Q6_K: 0.019, QType.Q5_K: 0.038, QType.Q4_K: 0.075, QType.Q4_0: 0.09}
QUANTIZABLE = [*FLOAT_TYPES, *ROUND_TRIP_BOUNDS, QType.MXFP4]
MXFP4_ROUND_TRIP = 0.12  # e2m1 codes under a power-of-two scale: measured 11.5% on Gaussian weights
F16_EXTREMES = [0x7BFF, 0xFBFF, 0x0400, 0x8400, 0x0001, 0x8001, 0x0000, 0x8000]  # +-max, +-min normal, ...


def finite_f16_bits(bits: int) -> int:
    """Any 16-bit pattern -> a finite fp16 pattern (an inf/NaN exponent becomes a subnormal)."""
    return bits & 0x83FF if bits & 0x7C00 == 0x7C00 else bits


# drawn as bit patterns, not floats(width=16), which filters and trips hypothesis's health check
finite_f16 = st.sampled_from(F16_EXTREMES) | st.integers(0, 0xFFFF).map(finite_f16_bits)


def reference(blocks: torch.Tensor, qtype: QType) -> torch.Tensor:
    """gguf-py's numpy dequantization of uint8 `[n, type_size]` -> float32 `[n, block_size]`."""
    with np.errstate(over="ignore"):  # MXFP4 with large exponents overflows to inf, as ggml does
        out = gguf.quants.dequantize(blocks.cpu().numpy(), qtype)
    return torch.from_numpy(np.array(out, dtype=np.float32))


def assert_bit_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal float32 bit patterns; a NaN matches only a NaN of the reference in the same place."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    same = (ours.view(torch.int32) == ref.view(torch.int32)) | (ours.isnan() & ref.isnan())
    if not same.all():
        where = tuple(int(i) for i in (~same).nonzero()[0])
        raise AssertionError(f"first mismatch at {where}: ours {ours[where]!r}, reference {ref[where]!r}")


def random_f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniformly random finite fp16 bit patterns (all exponents, subnormals, +-0, +-65504), `[n, 2]`."""
    bits = np.array([finite_f16_bits(int(b)) for b in rng.integers(0, 1 << 16, n)], dtype=np.uint16)
    return bits.view(np.uint8).reshape(n, 2)


@st.composite
def valid_blocks(draw: st.DrawFn, qtype: QType) -> torch.Tensor:
    """Arbitrary bytes with finite fp16 scale fields; float formats and MXFP4 exponents stay arbitrary."""
    fmt = quants.format_of(qtype)
    n = draw(st.integers(1, 6))
    raw = draw(st.binary(min_size=n * fmt.type_size, max_size=n * fmt.type_size))
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n, fmt.type_size).copy()
    for offset, _ in fmt.f16_fields:
        bits = draw(st.lists(finite_f16, min_size=n, max_size=n))
        blocks[:, offset : offset + 2] = np.array(bits, dtype=np.uint16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(blocks)


def gaussian(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def rel_rms(y: torch.Tensor, x: torch.Tensor) -> float:
    return ((y - x).square().mean() / x.square().mean()).sqrt().item()


# --- dequantization is bit-exact against gguf-py ------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_dequantize_matches_gguf_on_arbitrary_valid_blocks(qtype: QType, data: st.DataObject) -> None:
    blocks = data.draw(valid_blocks(qtype))
    assert_bit_equal(quants.format_of(qtype).dequantize_blocks(blocks), reference(blocks, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_many_random_blocks(qtype: QType) -> None:
    # thousands of uniformly random blocks with scales across the whole finite fp16 range
    fmt = quants.format_of(qtype)
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, (4096, fmt.type_size), dtype=np.uint8)
    for offset, _ in fmt.f16_fields:
        blocks[:, offset : offset + 2] = random_f16_scales(rng, 4096)
    blocks_t = torch.from_numpy(blocks)
    assert_bit_equal(fmt.dequantize_blocks(blocks_t), reference(blocks_t, qtype))


def test_mxfp4_covers_every_exponent() -> None:
    blocks = torch.randint(0, 256, (256, 17), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blocks[:, 0] = torch.arange(256, dtype=torch.uint8)
    ours = quants.format_of(QType.MXFP4).dequantize_blocks(blocks)
    assert_bit_equal(ours, reference(blocks, QType.MXFP4))
    assert ours.isinf().any() and (ours[:2] != 0).any()  # overflow at the top, subnormal scales at the bottom


def test_bit_equality_check_rejects_a_one_ulp_difference() -> None:
    x = torch.tensor([1.0, float("nan")])
    assert_bit_equal(x, x.clone())
    with pytest.raises(AssertionError, match="first mismatch at \\(0,\\)"):
        assert_bit_equal(torch.nextafter(x, torch.full_like(x, 2.0)), x)
    with pytest.raises(AssertionError):
        assert_bit_equal(torch.tensor([float("nan")]), torch.tensor([0.0]))


# --- quantizers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUNDS), ids=lambda t: t.name)
def test_round_trip_error_on_gaussian_weights(qtype: QType) -> None:
    x = gaussian(64, 1024) * 0.02
    y = quants.dequantize(quants.quantize(x, qtype), qtype, 1024)
    assert rel_rms(y, x) < ROUND_TRIP_BOUNDS[qtype]


# worst |error| over a block's largest magnitude seen on mixed data: 0.0077, 0.016, 0.049, 0.086; Q4_0:
# d = -peak / 8, so a value of -peak's size is clamped to code 15 (7 d): an error of d = peak / 8
BLOCK_ERROR_BOUNDS = {QType.Q8_0: 0.01, QType.Q6_K: 0.03, QType.Q5_K: 0.08, QType.Q4_K: 0.15, QType.Q4_0: 0.126}
# NOTE: the block scales are f16: below 2**-14 they are subnormal, rounded to 2**-25 at worst, and that
# error is multiplied by the largest code x sub-scale (scale and min terms for Q4_K / Q5_K)
LARGEST_CODE_X_SCALE = {QType.Q8_0: 127, QType.Q6_K: 32 * 128, QType.Q5_K: 2 * 31 * 63, QType.Q4_K: 2 * 15 * 63,
                        QType.Q4_0: 8}
BLOCK_ERROR_FLOORS = {qtype: n * 2.0 ** -25 for qtype, n in LARGEST_CODE_X_SCALE.items()}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUNDS), ids=lambda t: t.name)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-2, 1.0, 100.0]),
    spread=st.floats(0, 3),
    offset=st.floats(-2, 2),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
)
def test_quantized_blocks_decode_the_same_in_gguf(
    qtype: QType, seed: int, magnitude: float, spread: float, offset: float, zero_fraction: float
) -> None:
    # Gaussian weights whose 16-weight groups differ in scale by up to 10**spread, shifted, partly zero
    fmt, gen = quants.format_of(qtype), torch.Generator().manual_seed(seed)
    x = torch.randn(3, fmt.block_size // 16, 16, generator=gen)
    x = x * 10 ** (spread * (torch.rand(3, fmt.block_size // 16, 1, generator=gen) - 0.5))
    x = (x.view(3, fmt.block_size) + offset) * magnitude
    x[torch.rand(x.shape, generator=gen) < zero_fraction] = 0.0
    blocks = fmt.quantize_blocks(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, fmt.type_size)
    ours = fmt.dequantize_blocks(blocks)
    assert_bit_equal(ours, reference(blocks, qtype))
    peak = x.abs().amax(1, keepdim=True)
    assert ((ours - x).abs() <= BLOCK_ERROR_BOUNDS[qtype] * peak + BLOCK_ERROR_FLOORS[qtype]).all()


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0], ids=lambda t: t.name)
@settings(max_examples=50, deadline=None)
@given(x=st.lists(st.floats(-1e4, 1e4), min_size=64, max_size=64))  # rounded to float32 below
def test_32_weight_quantizers_match_gguf_byte_for_byte(qtype: QType, x: list[float]) -> None:
    data = torch.tensor(x).view(2, 32)
    expected = gguf.quants.quantize(data.numpy(), qtype)
    assert torch.equal(quants.quantize(data, qtype), torch.from_numpy(expected))


def test_q4_0_scale_comes_from_the_first_largest_magnitude_as_gguf() -> None:
    # rows 0 and 1: a tie between +8 and -8, in both orders; -8 first gives d = 1, +8 first d = -1
    x = torch.zeros(2, 32)
    x[0, 3], x[0, 9], x[1, 3], x[1, 9] = -8.0, 8.0, 8.0, -8.0
    raw = quants.quantize(x, QType.Q4_0)
    assert torch.equal(raw, torch.from_numpy(gguf.quants.quantize(x.numpy(), QType.Q4_0)))
    assert raw[:, :2].contiguous().view(torch.float16).flatten().tolist() == [1.0, -1.0]
    y = quants.dequantize(raw, QType.Q4_0, 32)
    assert y[0, 3] == -8 and y[0, 9] == 7 and y[1, 3] == 8 and y[1, 9] == -7  # code 16 is clamped to 15


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
       zero_fraction=st.sampled_from([0.0, 0.5, 1.0]))
def test_mxfp4_quantizer_matches_gguf_byte_for_byte(seed: int, magnitude: float, zero_fraction: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=gen) * magnitude * torch.exp(torch.randn(8, 1, generator=gen))
    x[torch.rand(x.shape, generator=gen) < zero_fraction] = 0.0
    expected = gguf.quants.quantize(x.numpy(), QType.MXFP4)
    assert torch.equal(quants.quantize(x, QType.MXFP4), torch.from_numpy(expected))


def test_q8_0_rounds_ties_away_from_zero_as_gguf() -> None:
    # d = 1 exactly, so every x * (1 / d) below is a tie
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [0.0] * 24).view(1, 32)
    raw = quants.quantize(x, QType.Q8_0)
    assert torch.equal(raw, torch.from_numpy(gguf.quants.quantize(x.numpy(), QType.Q8_0)))
    assert raw[0, 2:10].view(torch.int8).tolist() == [127, 1, 2, 3, -1, -2, -3, 127]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_zero_and_constant_rows_survive_quantization(qtype: QType) -> None:
    x = torch.zeros(4, 512)
    x[1], x[2], x[3] = 0.5, -0.25, torch.linspace(-1, 1, 512)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, 512)
    assert torch.equal(y[0], x[0])
    assert torch.allclose(y[1:3], x[1:3], rtol=0.01, atol=0)
    assert rel_rms(y[3], x[3]) < {**ROUND_TRIP_BOUNDS, QType.MXFP4: MXFP4_ROUND_TRIP}.get(qtype, 0.01)


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_formats_round_trip_through_their_dtype(qtype: QType) -> None:
    x = gaussian(3, 64)
    dtype = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}[qtype]
    y = quants.dequantize(quants.quantize(x, qtype), qtype, 64)
    assert torch.equal(y, x.to(dtype).float())


def test_formats_without_quantizer_raise_value_error_naming_the_type() -> None:
    with pytest.raises(ValueError, match="Q4_1 has no quantizer.*Q4_K"):
        quants.quantize(torch.zeros(2, 32), QType.Q4_1)
    assert {t for t in ALL_TYPES if quants.format_of(t).can_quantize} == set(QUANTIZABLE)


# --- random blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.002, 0.02, 0.5])
def test_random_blocks_are_finite_with_rms_about_scale(qtype: QType, scale: float) -> None:
    fmt = quants.format_of(qtype)
    num_blocks = 4096 * 32 // fmt.block_size
    blocks = quants.random_blocks(qtype, num_blocks, torch.Generator().manual_seed(1), scale)
    assert blocks.dtype == torch.uint8 and blocks.shape == (num_blocks, fmt.type_size)
    weights = fmt.dequantize_blocks(blocks)
    assert weights.isfinite().all()
    rms = weights.square().mean().sqrt().item()
    assert scale / 1.5 < rms < scale * 1.5
    assert weights.abs().max().item() < scale * 100  # no stray huge values


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32), scale=st.floats(1e-3, 10.0))
def test_random_blocks_decode_the_same_in_gguf(qtype: QType, seed: int, scale: float) -> None:
    blocks = quants.random_blocks(qtype, 16, torch.Generator().manual_seed(seed), scale)
    assert_bit_equal(quants.format_of(qtype).dequantize_blocks(blocks), reference(blocks, qtype))


def test_random_blocks_follow_the_generator() -> None:
    def draw(seed: int) -> torch.Tensor:
        return quants.random_blocks(QType.Q4_K, 64, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))
    codes = draw(7)[:, 16:].flatten()  # the quant bytes are uniformly random
    assert len(codes.unique()) == 256


def test_random_blocks_reject_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="num_blocks"):
        quants.random_blocks(QType.Q4_K, -1, gen)
    with pytest.raises(ValueError, match="scale"):
        quants.random_blocks(QType.Q4_K, 4, gen, scale=0.0)
    assert quants.random_blocks(QType.Q4_K, 0, gen).shape == (0, 144)


# --- shapes and the module API -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0, QType.MXFP4, QType.F16], ids=lambda t: t.name)
def test_dequantize_keeps_leading_dimensions(qtype: QType) -> None:
    fmt = quants.format_of(qtype)
    num_cols = 2 * max(fmt.block_size, 32)
    blocks = quants.random_blocks(qtype, 2 * 3 * num_cols // fmt.block_size, torch.Generator().manual_seed(0))
    raw = blocks.view(2, 3, quants.row_bytes(qtype, num_cols))
    out = quants.dequantize(raw, qtype, num_cols)
    assert out.shape == (2, 3, num_cols) and out.dtype == torch.float32
    assert torch.equal(out.view(-1, fmt.block_size), fmt.dequantize_blocks(blocks))
    assert torch.equal(quants.dequantize(raw.numpy(), qtype, num_cols), out)  # numpy input, same result


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantize_keeps_leading_dimensions(qtype: QType) -> None:
    x = gaussian(6, 512).view(2, 3, 512)
    raw = quants.quantize(x, qtype)
    assert raw.shape == (2, 3, quants.row_bytes(qtype, 512)) and raw.dtype == torch.uint8
    assert torch.equal(raw[1, 2], quants.quantize(x[1, 2], qtype))  # rows are quantized independently
    assert quants.dequantize(raw, qtype, 512).shape == (2, 3, 512)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_empty_inputs_give_empty_outputs(qtype: QType) -> None:
    fmt = quants.format_of(qtype)
    num_cols = 256
    assert quants.dequantize(
        torch.zeros(0, quants.row_bytes(qtype, num_cols), dtype=torch.uint8), qtype, num_cols
    ).shape == (0, num_cols)
    if fmt.can_quantize:
        assert quants.quantize(torch.zeros(0, 3, num_cols), qtype).shape == (0, 3, quants.row_bytes(qtype, num_cols))


def test_quantize_accepts_non_contiguous_input() -> None:
    x = gaussian(512, 4).t()  # [4, 512] with strides (1, 4)
    assert torch.equal(quants.quantize(x, QType.Q4_K), quants.quantize(x.contiguous(), QType.Q4_K))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_row_bytes_agrees_with_gguf(qtype: QType) -> None:
    fmt = quants.format_of(qtype)
    num_cols = 4 * fmt.block_size * 8
    assert quants.row_bytes(qtype, num_cols) == gguf.quants.quant_shape_to_byte_shape((num_cols,), qtype)[0]


def test_row_bytes_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="Q4_K: row of 300 is not a multiple of 256"):
        quants.row_bytes(QType.Q4_K, 300)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quants.quantize(torch.zeros(2, 48), QType.Q8_0)


def test_dequantize_rejects_rows_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="Q8_0: rows of 64 take 68 bytes"):
        quants.dequantize(torch.zeros(2, 34, dtype=torch.uint8), QType.Q8_0, 64)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        quants.dequantize(torch.zeros(2, 144, dtype=torch.uint8), QType.Q4_K, 200)


@pytest.mark.parametrize("qtype", [QType.IQ2_XXS, QType.Q8_1, int(QType.TQ1_0)], ids=str)
def test_unsupported_types_raise_value_error_naming_the_type(qtype: QType | int) -> None:
    name = QType(qtype).name
    with pytest.raises(ValueError, match=f"unsupported tensor type {name}"):
        quants.format_of(qtype)
    with pytest.raises(ValueError, match=name):
        quants.dequantize(torch.zeros(1, 66, dtype=torch.uint8), qtype, 256)
    with pytest.raises(ValueError, match=name):
        quants.random_blocks(qtype, 1, torch.Generator())


def test_unknown_type_number_raises_value_error() -> None:
    with pytest.raises(ValueError, match="unknown tensor type 9999"):
        quants.format_of(9999)


def test_supported_types_are_the_registered_formats() -> None:
    assert set(quants.supported_types()) == set(ALL_TYPES)
    for qtype in ALL_TYPES:
        fmt = quants.format_of(qtype)
        assert fmt.qtype == qtype
        assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[qtype]


# --- CUDA: the same torch code on the device -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_dequantize_and_random_blocks_match_cpu(qtype: QType) -> None:
    fmt = quants.format_of(qtype)
    blocks = quants.random_blocks(qtype, 1024, torch.Generator(device="cuda").manual_seed(0))
    assert blocks.is_cuda
    ours = fmt.dequantize_blocks(blocks)
    assert ours.is_cuda
    assert_bit_equal(ours.cpu(), reference(blocks, qtype))
    if qtype in ROUND_TRIP_BOUNDS:  # summation order may differ from the CPU, so compare decodings
        x = gaussian(64, 1024).cuda()
        raw = quants.quantize(x, qtype)
        assert raw.is_cuda
        assert_bit_equal(quants.dequantize(raw, qtype, 1024).cpu(), reference(raw, qtype).view(64, 1024))
        assert rel_rms(quants.dequantize(raw, qtype, 1024).cpu(), x.cpu()) < ROUND_TRIP_BOUNDS[qtype]
