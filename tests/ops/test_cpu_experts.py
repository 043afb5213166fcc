from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ops import native, quants
from ops.bank import ExpertWeights, random_expert_weights
from ops.cpu_experts import (
    NativeExperts,
    QType,
    expert_ffn_cpu,
    expert_ffn_tiled,
    load_native,
    native_available,
)
from ops.expert_ffn import expert_ffn, expert_ffn_reference, native_supports
from ops.expert_math import ExpertMath

# gate, up, down types; Q4_K gate/up + Q6_K down is the Q4_K_M layout, Q8_0 + Q4_K mixes two
# activation formats in one layer; MXFP4 is gpt-oss's, Q4_0 Gemma 4's
FORMATS = [
    (QType.Q4_K, QType.Q4_K, QType.Q4_K),
    (QType.Q5_K, QType.Q5_K, QType.Q5_K),
    (QType.Q6_K, QType.Q6_K, QType.Q6_K),
    (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    (QType.Q8_0, QType.Q4_K, QType.Q5_K),
    (QType.F16, QType.BF16, QType.F32),
    (QType.MXFP4, QType.MXFP4, QType.MXFP4),
    (QType.MXFP4, QType.Q4_K, QType.MXFP4),
    (QType.Q4_0, QType.Q4_0, QType.Q4_0),
    (QType.Q4_0, QType.Q8_0, QType.MXFP4),
]
# build flags -> the SIMD path they must select on an x86 machine with AVX-512 VNNI
VARIANTS = {(): None, ("-mno-avx512f",): "avx2", ("-DMOECACHE_SCALAR",): "scalar"}
FLOAT_TYPES = {QType.F16, QType.BF16, QType.F32}

# Elementwise, of max |output|, against the fp32 reference. The kernel's int8 activations come in two
# planes (the second rounds what the first lost): measured <= 1.3e-4 on every format and SIMD level. One
# plane alone is 1e-2 (1.8e-2 measured on Q4_K); a wrong scale, min or bit plane in a decoded block is of
# order 1.
INT8_ATOL = 3e-4
FLOAT_ATOL = 1e-5

HIDDEN, FF, NUM_EXPERTS = 512, 256, 6


# a bank's math: activation and which of the gate / up / down biases (by expert id) it has; a limit of 0.5 makes
# swiglu_oai's clamps bite on these weights (gate and up rms ~0.7 here)
MATHS = {
    "silu-biases": ("silu", "gud", 7.0),
    "swiglu_oai": ("swiglu_oai", "", 7.0),
    "swiglu_oai-biases": ("swiglu_oai", "gud", 7.0),
    "swiglu_oai-clamped": ("swiglu_oai", "gud", 0.5),
    "gelu": ("gelu", "", 7.0),
    "gelu-gate-down-biases": ("gelu", "gd", 7.0),
}
MATH_FORMATS = [(QType.MXFP4, QType.MXFP4, QType.MXFP4), (QType.Q4_K, QType.Q4_K, QType.Q6_K),
                (QType.Q4_0, QType.Q4_0, QType.Q4_0)]


def with_math(w: ExpertWeights, name: str, seed: int) -> ExpertWeights:
    """w with math MATHS[name], its biases random (rms 0.5, another row per expert)."""
    activation, which, limit = MATHS[name]
    g = torch.Generator().manual_seed(seed)
    bias = lambda key, n: torch.randn(w.num_experts, n, generator=g) * 0.5 if key in which else None  # noqa: E731
    math = ExpertMath(activation, bias("g", w.ff), bias("u", w.ff), bias("d", w.hidden), limit=limit)  # type: ignore[arg-type]
    return replace(w, math=math)


def kernel(flags: tuple[str, ...]) -> NativeExperts:
    lib = load_native(flags)
    if lib is None:
        pytest.skip(f"no C compiler for flags {flags}")
    if VARIANTS[flags] is not None and lib.simd != VARIANTS[flags]:
        pytest.skip(f"flags {flags} select {lib.simd} on this machine, not {VARIANTS[flags]}")
    return lib


def routing(seed: int, num_tokens: int = 5, num_pairs: int = 14) -> tuple[torch.Tensor, ...]:
    """Random pairs with repeated experts; token 2 gets no pair."""
    rng = np.random.default_rng(seed)
    tokens = rng.choice([t for t in range(num_tokens) if t != 2], num_pairs)
    experts = rng.integers(0, NUM_EXPERTS, num_pairs)
    weights = rng.uniform(0.05, 1.0, num_pairs).astype(np.float32)
    x = rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(tokens), torch.from_numpy(experts), torch.from_numpy(weights)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_close(out: torch.Tensor, reference: torch.Tensor, types: tuple[QType, ...]) -> None:
    atol = FLOAT_ATOL if set(types) <= FLOAT_TYPES else INT8_ATOL
    error = float((out - reference).abs().max() / reference.abs().max())
    assert error <= atol, f"max error {error:.2e} of max |output| (bound {atol:.0e})"


@pytest.mark.parametrize("flags", list(VARIANTS), ids=["native", "avx2", "scalar"])
@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_native_matches_reference(types: tuple[QType, QType, QType], flags: tuple[str, ...]) -> None:
    lib = kernel(flags)
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=1)
    x, token_ids, expert_ids, weights = routing(seed=2)
    out = lib.ffn(x, token_ids, expert_ids, weights, w)
    assert_close(out, expert_ffn_reference(x, token_ids, expert_ids, weights, w), types)
    assert torch.count_nonzero(out[2]) == 0  # the token without pairs


@pytest.mark.parametrize("flags", list(VARIANTS), ids=["native", "avx2", "scalar"])
@pytest.mark.parametrize("math", list(MATHS))
@pytest.mark.parametrize("types", MATH_FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_native_math_matches_reference(types: tuple[QType, QType, QType], math: str, flags: tuple[str, ...]) -> None:
    lib = kernel(flags)
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=1), math, seed=16)
    x, token_ids, expert_ids, weights = routing(seed=2)
    out = lib.ffn(x, token_ids, expert_ids, weights, w)
    assert_close(out, expert_ffn_reference(x, token_ids, expert_ids, weights, w), types)
    assert torch.count_nonzero(out[2]) == 0  # the token without pairs: no down bias either


def test_expert_ffn_takes_the_native_kernel_for_any_math(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel(())
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.MXFP4, seed=17), "swiglu_oai-biases", seed=18)
    assert native_supports(w)
    x, token_ids, expert_ids, weights = routing(seed=19)
    expert_ids[0] = -1  # a skipped pair
    monkeypatch.setattr("ops.expert_ffn.expert_ffn_reference", None)  # any other path fails
    out = expert_ffn(x, token_ids, expert_ids, weights, w)
    keep = expert_ids >= 0
    assert torch.equal(out, load_native().ffn(x, token_ids[keep], expert_ids[keep], weights[keep], w))  # type: ignore[union-attr]


def test_biases_of_another_shape_are_rejected() -> None:
    lib = kernel(())
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.MXFP4, seed=20), "silu-biases", seed=21)
    w = replace(w, math=replace(w.math, up_bias=w.math.up_bias[:-1]))  # type: ignore[index]
    with pytest.raises(ValueError, match="up_bias"):
        lib.ffn(*routing(seed=22), w)


@settings(max_examples=10, deadline=None)
@example(num_tokens=6, num_pairs=2, seed=31)  # a spike in h: one block of h far above the others
@given(num_tokens=st.integers(1, 12), num_pairs=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_any_routing_matches_reference(num_tokens: int, num_pairs: int, seed: int) -> None:
    lib = kernel(())
    types = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=3)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32))
    token_ids = torch.from_numpy(rng.integers(0, num_tokens, num_pairs))
    expert_ids = torch.from_numpy(rng.integers(0, NUM_EXPERTS, num_pairs))
    weights = torch.from_numpy(rng.uniform(0.0, 1.0, num_pairs).astype(np.float32))
    out = lib.ffn(x, token_ids, expert_ids, weights, w)
    assert out.shape == x.shape
    reference = expert_ffn_reference(x, token_ids, expert_ids, weights, w)
    if num_pairs:
        assert_close(out, reference, types)
    else:
        assert torch.count_nonzero(out) == 0


def test_thread_count_does_not_change_the_result() -> None:
    lib = kernel(())
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, QType.Q4_K, QType.Q6_K, seed=4)
    x, token_ids, expert_ids, weights = routing(seed=5, num_tokens=9, num_pairs=40)
    one = lib.ffn(x, token_ids, expert_ids, weights, w, num_threads=1)
    two = lib.ffn(x, token_ids, expert_ids, weights, w, num_threads=2)
    assert torch.equal(one, two)


@pytest.mark.parametrize(("types", "hidden", "ff"), [
    ((QType.Q8_0, QType.Q8_0, QType.Q8_0), 96, 160),  # odd block counts: the one-block tail of a pair
    ((QType.MXFP4, QType.MXFP4, QType.MXFP4), 96, 160),
    ((QType.Q4_0, QType.Q4_0, QType.Q4_0), 96, 160),
    ((QType.Q4_0, QType.Q4_0, QType.Q4_0), 352, 224),  # Gemma 4's 2816 x 704 over 8: 11 and 7 blocks a row
    ((QType.Q4_K, QType.Q5_K, QType.Q6_K), 256, 256),  # one super-block a row
])
@pytest.mark.parametrize("flags", list(VARIANTS), ids=["native", "avx2", "scalar"])
def test_short_rows_match_reference(types: tuple[QType, QType, QType], hidden: int, ff: int,
                                    flags: tuple[str, ...]) -> None:
    lib = kernel(flags)
    w = random_expert_weights(NUM_EXPERTS, hidden, ff, *types, seed=14)
    rng = np.random.default_rng(15)
    x = torch.from_numpy(rng.standard_normal((4, hidden), dtype=np.float32))
    token_ids, expert_ids = torch.from_numpy(rng.integers(0, 4, 11)), torch.from_numpy(rng.integers(0, NUM_EXPERTS, 11))
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, 11).astype(np.float32))
    out = lib.ffn(x, token_ids, expert_ids, weights, w, num_threads=3)
    assert_close(out, expert_ffn_reference(x, token_ids, expert_ids, weights, w), types)


def test_batch_equals_token_by_token() -> None:
    """12 tokens on one expert cross a tile of 8: sharing weight rows must not mix tokens."""
    lib = kernel(())
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q5_K, QType.Q5_K, QType.Q8_0, seed=6)
    x = torch.randn(12, HIDDEN)
    token_ids = torch.arange(12).repeat_interleave(2)
    expert_ids = torch.stack([torch.full((12,), 3), torch.arange(12) % NUM_EXPERTS], dim=1).reshape(-1)
    weights = torch.rand(24)
    batch = lib.ffn(x, token_ids, expert_ids, weights, w)
    for t in range(12):
        pairs = token_ids == t
        single = lib.ffn(x[t : t + 1], torch.zeros(2, dtype=torch.int64), expert_ids[pairs], weights[pairs], w)
        assert torch.equal(batch[t], single[0])


@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_torch_path_matches_reference(types: tuple[QType, QType, QType]) -> None:
    missing = [t.name for t in types if t not in quants.supported_types()]
    if missing:
        pytest.skip(f"ops.quants cannot dequantize {missing}")
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=7)
    x, token_ids, expert_ids, weights = routing(seed=8)
    out = expert_ffn_tiled(x, token_ids, expert_ids, weights, w)
    assert rel_err(out, expert_ffn_reference(x, token_ids, expert_ids, weights, w)) < FLOAT_ATOL


@pytest.mark.parametrize("math", list(MATHS))
def test_torch_path_computes_the_math(math: str) -> None:
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.MXFP4, seed=23), math, seed=24)
    x, token_ids, expert_ids, weights = routing(seed=25)
    out = expert_ffn_tiled(x, token_ids, expert_ids, weights, w)
    assert rel_err(out, expert_ffn_reference(x, token_ids, expert_ids, weights, w)) < FLOAT_ATOL


def test_without_compiler_torch_path_is_used_and_warned_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent")
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q8_0, seed=9)
    x, token_ids, expert_ids, weights = routing(seed=10)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        outs = [expert_ffn_cpu(x, token_ids, expert_ids, weights, w) for _ in range(2)]
        assert not native_available()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "/nonexistent" in caplog.records[0].getMessage()
    assert list(tmp_path.glob("*.so")) == []
    reference = expert_ffn_reference(x, token_ids, expert_ids, weights, w)
    # fp32 accuracy: the native path's int8 activations would be ~1e-4 off
    assert all(rel_err(out, reference) < FLOAT_ATOL for out in outs)


def test_builds_once_per_source_and_flags(native_cache: Path) -> None:
    kernel(())
    default = native.build_key(native.CSRC / "cpu_experts.c", native.BASE_FLAGS, native.compiler())
    scalar = native.build_key(
        native.CSRC / "cpu_experts.c", (*native.BASE_FLAGS, "-DMOECACHE_SCALAR"), native.compiler()
    )
    assert default != scalar
    assert (native_cache / f"cpu_experts-{default}.so").is_file()
    assert load_native() is load_native()


@pytest.mark.parametrize(("field", "bad", "message"), [("token_ids", 5, "token id"), ("expert_ids", 6, "expert id")])
def test_out_of_range_ids_are_rejected(field: str, bad: int, message: str) -> None:
    lib = kernel(())
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=11)
    x, token_ids, expert_ids, weights = routing(seed=12)
    args = {"token_ids": token_ids.clone(), "expert_ids": expert_ids.clone()}
    args[field][3] = bad
    with pytest.raises(ValueError, match=message):
        lib.ffn(x, args["token_ids"], args["expert_ids"], weights, w)
