"""The fused decode kernels (`ops.triton.fused`) against their torch references (`ops.fused`, the
engine's CPU path).

Fresh random inputs every run. Tolerances: the kernels compute in float32 and round once; the references
round bf16/fp16 after each op (normed, weight * normed, cos/sin, each product and sum). An rms_norm
output is compared relative to itself; a rotated element relative to itself plus its pair's magnitude
(x1*cos - x2*sin can cancel, but its rounding errors scale with |(x1, x2)|). Measured worst cases:
float32 2.5e-7, bf16 8e-3 (1.3e-2 under the interpreter, which truncates float32 -> bf16 instead of
rounding to nearest), fp16 1.4e-3. Routing: logits without ties (bf16/fp16 logits are a shuffled grid
of distinct exact values), so the ids must match exactly; weights within 1e-6.

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA, the same checks run on small shapes under
Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles anything).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from engine.model import rope_frequencies
from ops.fused import (
    KVWrite,
    add_rms_norm_torch,
    gated_act_torch,
    qk_norm_rope_torch,
    rms_norm_torch,
    route_topk_torch,
    routed_weights_torch,
    sandwich_norm_torch,
    write_kv_torch,
)

triton = pytest.importorskip("triton", reason="triton is not installed: the fused GPU kernels need it")

from ops.triton.fused import (  # noqa: E402
    add_rms_norm,
    gated_act,
    qk_norm_rope,
    rms_norm,
    route_topk,
    routed_weights,
    sandwich_norm,
)
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # 2 ulps of bf16 / fp16
WEIGHT_ATOL = 1e-6
EPS = 1e-6
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def seed() -> int:
    return int(torch.randint(1 << 30, ()))


def inv_freq(head_dim: int, theta: float = 1e6) -> torch.Tensor:
    return rope_frequencies(head_dim, theta, 1.0, torch.device("cpu"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, floor: torch.Tensor | float = 0.0) -> float:
    """|out - ref| <= tol * (|ref| + floor) everywhere; returns the worst ratio."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert out.isfinite().all(), "non-finite outputs"
    out, ref = out.cpu().double(), ref.double()
    ratio = ((out - ref).abs() / (ref.abs() + floor + 1e-30)).max().item()
    assert ratio <= tol, f"error {ratio:.2e} > {tol:.2e}"
    return ratio


def pair_magnitude(x: torch.Tensor, style: str) -> torch.Tensor:
    """|(x1, x2)| of each element's rotation pair, in x's layout."""
    x = x.double()
    if style == "neox":
        a, b = x.chunk(2, dim=-1)
        n = (a * a + b * b).sqrt()
        return torch.cat((n, n), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    n = (a * a + b * b).sqrt()
    return torch.stack((n, n), dim=-1).flatten(-2)


def random_logits(tokens: int, experts: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """float32: normal; bf16/fp16: each row a shuffle of distinct values k * 2^-s in (-4, 4), exact in both."""
    if dtype == torch.float32:
        return torch.randn(tokens, experts, generator=gen) * 2
    step = 2.0 ** -max(0, math.ceil(math.log2(experts / 8)))
    order = torch.rand(tokens, experts, generator=gen).argsort(dim=1)
    return ((order - experts // 2) * step).to(dtype)


def random_mask(tokens: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(tokens, generator=gen) < 0.6
    mask[-1] = False
    return mask


# --- checks shared by the CUDA tests and the interpreter run --------------------------------------------


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int,
                   strided: bool = False) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape[:-1], shape[-1] + (16 if strided else 0), generator=gen) * 3).to(dtype)
    x = x[..., :shape[-1]]  # strided: rows longer than dim
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    out = rms_norm(x.to(device), weight.to(device), EPS)
    # floor: the smallest normal number (fp16 subnormals near 0 have fewer bits than TOL assumes)
    return assert_close(out, rms_norm_torch(x, weight, EPS), TOL[dtype], torch.finfo(dtype).tiny)


def check_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    x, update = ((torch.randn(*shape, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    total, normed = add_rms_norm(x.to(device), update.to(device), weight.to(device), EPS)
    ref_total, ref_normed = add_rms_norm_torch(x, update, weight, EPS)
    if device.type == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(total.cpu(), ref_total), "the residual sum must have the bits of x + update"
    else:  # the interpreter truncates float32 -> bf16: within 1 ulp, and the norm is of that sum
        assert_close(total, ref_total, 2 ** -7)
        ref_normed = rms_norm_torch(total.cpu(), weight, EPS)
    return assert_close(normed, ref_normed, TOL[dtype], torch.finfo(dtype).tiny)


def check_sandwich_norm(tokens: int, dtype: torch.dtype, device: torch.device, seed: int, has_b: bool,
                        has_post: bool, scale: float, num_next: int) -> float:
    """y = (x + [post-norm of] (norm a [+ norm b])) * scale against the torch reference, within a few ulps of |x| + 1
    (each norm's output is O(1); the chain's roundings may differ by an ulp where the reference rounds twice), and the
    next norms of the kernel's own y as `rms_norm_torch` gives them."""
    gen = torch.Generator().manual_seed(seed)
    x, a, b = ((torch.randn(tokens, 512, generator=gen) * 3).to(dtype) for _ in range(3))
    wa, wb, wp, *following = ((torch.rand(512, generator=gen) + 0.5).to(dtype) for _ in range(3 + num_next))
    args = (EPS, b if has_b else None, wb if has_b else None, wp if has_post else None, scale)
    y, outs = sandwich_norm(x.to(device), a.to(device), wa.to(device), args[0],
                            *(t.to(device) if isinstance(t, torch.Tensor) else t for t in args[1:]),
                            tuple(w.to(device) for w in following))
    ref_y, ref_outs = sandwich_norm_torch(x, a, wa, *args, tuple(following))
    assert len(outs) == len(ref_outs) == num_next
    worst = assert_close(y, ref_y, 4 * TOL[dtype], x.abs().float() * abs(scale) + 4.0)
    for out, w in zip(outs, following):
        worst = max(worst, assert_close(out, rms_norm_torch(y.cpu(), w, EPS), TOL[dtype], torch.finfo(dtype).tiny))
    return worst


def check_gated_act(tokens: int, ff: int, activation: str, dtype: torch.dtype, device: torch.device,
                    seed: int) -> float:
    """act(gate) * up against the torch reference in float64, rounded once to the dtype: within 2 ulps of the product's
    magnitude (the kernel rounds the activation to the dtype before the product). NOTE: not the float32 reference:
    its GELU, 0.5 g (1 + tanh(z)), cancels where g < 0 (1 + tanh(z) is 3.5e-5 at g = -4, an ulp of 1 is 1.7e-3 of it);
    the kernel's g sigmoid(2z) does not, and a float32 reference failed it by 1.5e-4 (H100, 2026-12-06)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(tokens, 2 * ff, generator=gen) * 3).to(dtype)
    out = gated_act(gate_up.to(device), activation)
    ref = gated_act_torch(gate_up.double(), activation).to(dtype)  # type: ignore[arg-type]
    floor = gate_up[:, ff:].abs().float() * 2 ** -10  # act near 0: an ulp of act times |up|
    return assert_close(out, ref, 2 * TOL[dtype], floor.to(dtype).float().clamp(min=torch.finfo(dtype).tiny))


def check_qk_norm_rope(tokens: int, heads: int, head_dim: int, style: str, has_norm: bool, dtype: torch.dtype,
                       device: torch.device, seed: int, strided: bool = False) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads + (3 if strided else 0), head_dim, generator=gen).to(dtype)
    x = x[:, 1:heads + 1] if strided else x  # strided: q of a fused qkv projection
    weight = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype) if has_norm else None
    positions = torch.randint(0, 1 << 17, (tokens,), generator=gen)
    freqs = inv_freq(head_dim)
    out = qk_norm_rope(x.to(device), None if weight is None else weight.to(device), positions.to(device),
                       freqs.to(device), style, EPS)  # type: ignore[arg-type]
    ref = qk_norm_rope_torch(x, weight, positions, freqs, style, EPS)  # type: ignore[arg-type]
    return assert_close(out, ref, TOL[dtype], pair_magnitude(ref, style))


def check_qk_pair(tokens: int, q_heads: int, k_heads: int, style: str, has_norm: bool, dtype: torch.dtype,
                  device: torch.device, seed: int, head_dim: int = 128) -> float:
    """q and k heads of a fused q/k/v projection in one launch, against two reference calls: keys normed
    with their own weight."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(dtype)
    x = qkv[:, :(q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
    q_norm, k_norm = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) if has_norm else None for _ in range(2))
    positions, freqs = torch.randint(0, 1 << 17, (tokens,), generator=gen), inv_freq(head_dim)
    q_w, k_w = (None if w is None else w.to(device) for w in (q_norm, k_norm))
    out = qk_norm_rope(x.to(device), q_w, positions.to(device), freqs.to(device), style, EPS,  # type: ignore[arg-type]
                       k_w, q_heads)
    ref = torch.cat([qk_norm_rope_torch(x[:, :q_heads], q_norm, positions, freqs, style, EPS),  # type: ignore[arg-type]
                     qk_norm_rope_torch(x[:, q_heads:], k_norm, positions, freqs, style, EPS)], dim=1)  # type: ignore[arg-type]
    if has_norm:  # the keys' own weight matters: with q's weight they would differ
        assert not torch.allclose(ref[:, q_heads:], qk_norm_rope_torch(x[:, q_heads:], q_norm, positions, freqs,
                                                                       style, EPS))  # type: ignore[arg-type]
    return assert_close(out, ref, TOL[dtype], pair_magnitude(ref, style))


def check_qk_cache_write(tokens: int, q_heads: int, k_heads: int, style: str, dtype: torch.dtype,
                         device: torch.device, seed: int, head_dim: int = 64) -> float:
    """q and k heads rotated with the keys and the values stored into a layer's caches in the same launch: the
    caches bit for bit what `write_kv` stores from the launch's own keys (scattered slots and positions, the other
    rows untouched), the rotation as without the write."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(dtype).to(device)
    x = qkv[:, :(q_heads + k_heads) * head_dim].view(tokens, q_heads + k_heads, head_dim)
    v = qkv[:, (q_heads + k_heads) * head_dim:].view(tokens, k_heads, head_dim)
    norms = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device) for _ in range(2)]
    positions = torch.randperm(80, generator=gen)[:tokens].to(device)  # distinct (slot, position) pairs
    slots = torch.randint(0, 3, (tokens,), generator=gen).to(device)
    freqs = inv_freq(head_dim).to(device)
    k_cache, v_cache = (torch.randn(3, k_heads, 80, head_dim, generator=gen).to(dtype).to(device) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = qk_norm_rope(x, norms[0], positions, freqs, style, EPS, norms[1], q_heads,  # type: ignore[arg-type]
                       KVWrite(k_cache, v_cache, slots, v))
    alone = qk_norm_rope(x, norms[0], positions, freqs, style, EPS, norms[1], q_heads)  # type: ignore[arg-type]
    assert torch.equal(out, alone)
    write_kv_torch(k_ref, v_ref, slots, positions, alone[:, q_heads:], v)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    return 0.0


def check_route_topk(tokens: int, experts: int, top_k: int, norm_topk: bool, masked: bool, dtype: torch.dtype,
                     device: torch.device, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(tokens, experts, dtype, gen)
    mask = random_mask(tokens, gen) if masked else None
    ids, weights = route_topk(logits.to(device), top_k, norm_topk, None if mask is None else mask.to(device))
    ref_ids, ref_weights = route_topk_torch(logits, top_k, norm_topk, mask)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids), f"ids {ids.cpu().tolist()} != {ref_ids.tolist()}"
    error = (weights.cpu() - ref_weights).abs().max().item()
    assert error <= WEIGHT_ATOL, f"weights off by {error:.2e}"
    return error


def check_routed_weights(tokens: int, experts: int, top_k: int, norm_topk: bool, masked: bool,
                         dtype: torch.dtype, id_dtype: torch.dtype, device: torch.device, seed: int,
                         out_of_range: bool = False) -> float:
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(tokens, experts, dtype, gen)
    given = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(id_dtype)
    mask = random_mask(tokens, gen) if masked else None
    if out_of_range:  # ids -1 and `experts` in row 0: id -1, weight 0, the rest renormalised alone
        given[0, 0], given[0, -1] = -1, experts
    ids, weights = routed_weights(logits.to(device), given.to(device), norm_topk,
                                  None if mask is None else mask.to(device))
    is_valid = (given >= 0) & (given < experts)
    ref_ids, ref_weights = routed_weights_torch(logits, given.clamp(0, experts - 1), False, mask)
    ref_ids, ref_weights = torch.where(is_valid, ref_ids, -1), torch.where(is_valid, ref_weights, 0.0)
    if norm_topk:
        ref_weights = ref_weights / ref_weights.sum(dim=-1, keepdim=True)
    if not out_of_range:  # the reference itself, unedited
        assert torch.equal(ref_weights, routed_weights_torch(logits, given, norm_topk, mask)[1])
    assert torch.equal(ids.cpu(), ref_ids)
    error = (weights.cpu() - ref_weights).abs().max().item()
    assert error <= WEIGHT_ATOL, f"weights off by {error:.2e}"
    return error


# --- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 2048), (7, 2048), (32, 2048), (7, 32, 128), (32, 4, 128)], ids=str)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_rms_norm(shape, dtype, CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=[*DTYPE_IDS, "fp16"])
def test_rms_norm_strided_rows_and_fp16(dtype: torch.dtype) -> None:
    check_rms_norm((7, 2048), dtype, CUDA, seed(), strided=True)
    check_rms_norm((7, 4096), dtype, CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=[*DTYPE_IDS, "fp16"])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_add_rms_norm(tokens: int, dtype: torch.dtype) -> None:
    check_add_rms_norm((tokens, 2048), dtype, CUDA, seed())


# Gemma 4's block ends: after attention (no b, no post-norm, the FFN's norms next: 1 for a dense layer, 3 for an MoE
# layer), after the FFN (b, a post-norm, the output scale, the next attention norm; none after the last layer)
SANDWICHES = [(False, False, 1.0, 1), (False, False, 1.0, 3), (True, True, 0.5, 1), (True, True, 1.0, 0),
              (False, False, 0.25, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=[*DTYPE_IDS, "fp16"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_act(activation: str, dtype: torch.dtype) -> None:
    check_gated_act(7, 2112, activation, dtype, CUDA, seed())  # Gemma 4's dense MLP: 2112 columns, 3 programs a row


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sandwich", SANDWICHES, ids=lambda c: f"b{int(c[0])}-post{int(c[1])}-x{c[2]}-next{c[3]}")
def test_sandwich_norm(sandwich: tuple[bool, bool, float, int], dtype: torch.dtype) -> None:
    check_sandwich_norm(7, dtype, CUDA, seed(), *sandwich)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("has_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("style", ["neox", "normal"])
@pytest.mark.parametrize("heads", [32, 4])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_qk_norm_rope(tokens: int, heads: int, style: str, has_norm: bool, dtype: torch.dtype) -> None:
    check_qk_norm_rope(tokens, heads, 128, style, has_norm, dtype, CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("has_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("tokens", [1, 32])
def test_qk_norm_rope_of_q_and_k_in_one_launch(tokens: int, has_norm: bool) -> None:
    check_qk_pair(tokens, 32, 4, "neox", has_norm, torch.bfloat16, CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_qk_norm_rope_writes_the_caches(tokens: int) -> None:
    check_qk_cache_write(tokens, 32, 4, "neox", torch.bfloat16, CUDA, seed(), head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["neox", "normal"])
def test_qk_norm_rope_strided_heads_and_fp16(style: str) -> None:
    check_qk_norm_rope(7, 32, 128, style, True, torch.bfloat16, CUDA, seed(), strided=True)
    check_qk_norm_rope(7, 4, 64, style, True, torch.float16, CUDA, seed())


ROUTERS = [(128, 8), (60, 4), (512, 16)]  # experts, top_k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("norm_topk", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("tokens", [1, 7, 32])
@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: f"{r[0]}top{r[1]}")
def test_route_topk(router: tuple[int, int], tokens: int, norm_topk: bool, masked: bool,
                    dtype: torch.dtype) -> None:
    check_route_topk(tokens, *router, norm_topk, masked, dtype, CUDA, seed())


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("norm_topk", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: f"{r[0]}top{r[1]}")
def test_routed_weights(router: tuple[int, int], norm_topk: bool, id_dtype: torch.dtype) -> None:
    for tokens, dtype in [(1, torch.float32), (7, torch.bfloat16), (32, torch.float16)]:
        check_routed_weights(tokens, *router, norm_topk, True, dtype, id_dtype, CUDA, seed())
    check_routed_weights(7, *router, norm_topk, False, torch.float32, id_dtype, CUDA, seed(), out_of_range=True)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_inputs() -> None:
    gen = torch.Generator().manual_seed(seed())
    dtype, tokens = torch.bfloat16, 4
    x, update = (torch.randn(tokens, 2048, generator=gen).to(dtype).to(CUDA) for _ in range(2))
    weight = (torch.rand(2048, generator=gen) + 0.5).to(dtype).to(CUDA)
    q = torch.randn(tokens, 32, 128, generator=gen).to(dtype).to(CUDA)
    q_norm = (torch.rand(128, generator=gen) + 0.5).to(dtype).to(CUDA)
    positions, freqs = torch.zeros(tokens, dtype=torch.int64, device=CUDA), inv_freq(128).to(CUDA)
    logits = random_logits(tokens, 128, dtype, gen).to(CUDA)
    mask = torch.ones(tokens, dtype=torch.bool, device=CUDA)

    def step() -> tuple[torch.Tensor, ...]:
        total, normed = add_rms_norm(x, update, weight, EPS)
        return (total, normed, qk_norm_rope(q, q_norm, positions, freqs, "neox", EPS),
                *route_topk(logits, 8, True, mask))

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        x.copy_(torch.randn(tokens, 2048, generator=gen)), update.copy_(torch.randn(tokens, 2048, generator=gen))
        q.copy_(torch.randn(tokens, 32, 128, generator=gen))
        positions.copy_(torch.randint(0, 1 << 16, (tokens,), generator=gen))
        logits.copy_(random_logits(tokens, 128, dtype, gen)), mask.copy_(random_mask(tokens, gen))
        graph.replay()
        total, normed = add_rms_norm_torch(x.cpu(), update.cpu(), weight.cpu(), EPS)
        rotated = qk_norm_rope_torch(q.cpu(), q_norm.cpu(), positions.cpu(), freqs.cpu(), "neox", EPS)
        ids, weights = route_topk_torch(logits.cpu(), 8, True, mask.cpu())
        assert torch.equal(outs[0].cpu(), total)
        assert_close(outs[1], normed, TOL[dtype])
        assert_close(outs[2], rotated, TOL[dtype], pair_magnitude(rotated, "neox"))
        assert torch.equal(outs[3].cpu(), ids) and (outs[4].cpu() - weights).abs().max() <= WEIGHT_ATOL


# --- anywhere (argument checks launch nothing) ------------------------------------------------------------


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    if torch.cuda.is_available():
        return CUDA
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device check accepts CPU tensors
    return torch.device("cpu")


def test_norms_reject_bad_inputs(device: torch.device) -> None:
    x, weight = torch.randn(3, 256, device=device), torch.ones(256, device=device)
    for bad_weight in (weight[:-1], weight.half(), weight[None]):
        with pytest.raises(ValueError, match="weight"):
            rms_norm(x, bad_weight, EPS)
    for bad_x in (x.int(), torch.randn(256, 3, device=device).t(), torch.randn(3, 4, 256, device=device)[:, :2]):
        with pytest.raises(ValueError, match="x"):
            rms_norm(bad_x, weight, EPS)
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.randn(1, 32768, device=device), torch.ones(32768, device=device), EPS)
    with pytest.raises(ValueError, match="update"):
        add_rms_norm(x, x[:2], weight, EPS)
    with pytest.raises(ValueError, match="update"):
        add_rms_norm(x, x.half(), weight, EPS)


def test_qk_norm_rope_rejects_bad_inputs(device: torch.device) -> None:
    q, weight = torch.randn(2, 4, 64, device=device), torch.ones(64, device=device)
    positions, freqs = torch.arange(2, device=device), inv_freq(64).to(device)
    bad_args = {
        "x": [(q[0], weight, positions, freqs, "neox"), (q[..., :63], weight[:63], positions, freqs[:31], "neox"),
              (q.transpose(1, 2).contiguous().transpose(1, 2), weight, positions, freqs, "neox")],
        "norm_weight": [(q, weight[:32], positions, freqs, "neox"), (q, weight.bfloat16(), positions, freqs, "neox")],
        "positions": [(q, weight, positions.float(), freqs, "neox"), (q, weight, positions[:1], freqs, "neox")],
        "inv_freq": [(q, weight, positions, freqs.double(), "neox"), (q, weight, positions, freqs[:16], "neox")],
        "style": [(q, weight, positions, freqs, "gptj")],
        "k_norm_weight": [(q, weight, positions, freqs, "neox", EPS, None, 2),
                          (q, weight, positions, freqs, "neox", EPS, weight, 5),
                          (q, weight, positions, freqs, "neox", EPS, weight[:32], 2)],
    }
    for name, cases in bad_args.items():
        for args in cases:
            with pytest.raises(ValueError, match=name):
                qk_norm_rope(*(args if len(args) > 5 else (*args, EPS)))  # type: ignore[arg-type]


def test_routing_rejects_bad_inputs(device: torch.device) -> None:
    logits, mask = torch.randn(3, 60, device=device), torch.ones(3, dtype=torch.bool, device=device)
    ids = torch.zeros(3, 4, dtype=torch.int64, device=device)
    for top_k in (0, 61):
        with pytest.raises(ValueError, match="top_k"):
            route_topk(logits, top_k, True)
    for bad in (logits[0], logits.int(), torch.randn(3, 2048, device=device), torch.randn(60, 3, device=device).t()):
        with pytest.raises(ValueError, match="logits"):
            route_topk(bad, 4, True)
    for bad_mask in (mask.int(), mask[:2]):
        with pytest.raises(ValueError, match="token_mask"):
            route_topk(logits, 4, True, bad_mask)
    for bad_ids in (ids.float(), ids[:2], ids[0]):
        with pytest.raises(ValueError, match="expert_ids"):
            routed_weights(logits, bad_ids, True)


def test_empty_batches_launch_nothing(device: torch.device) -> None:
    x, weight = torch.empty(0, 256, device=device), torch.ones(256, device=device)
    assert rms_norm(x, weight, EPS).shape == (0, 256)
    assert all(t.shape == (0, 256) for t in add_rms_norm(x, x, weight, EPS))
    q, positions = torch.empty(0, 4, 64, device=device), torch.empty(0, dtype=torch.int64, device=device)
    assert qk_norm_rope(q, None, positions, inv_freq(64).to(device), "normal", EPS).shape == (0, 4, 64)
    ids, weights = route_topk(torch.empty(0, 60, device=device), 4, True)
    assert ids.shape == weights.shape == (0, 4) and ids.dtype == torch.int64


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on CPU tensors")
def test_cpu_tensors_need_cuda_or_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm(torch.randn(2, 64), torch.ones(64), EPS)
    with pytest.raises(ValueError, match="CUDA"):
        qk_norm_rope(torch.randn(2, 4, 64), None, torch.arange(2), inv_freq(64), "neox", EPS)
    with pytest.raises(ValueError, match="CUDA"):
        route_topk(torch.randn(2, 60), 4, True)


# --- the interpreter (no CUDA) ----------------------------------------------------------------------------

F32, BF16, F16, CPU = torch.float32, torch.bfloat16, torch.float16, torch.device("cpu")
INTERPRETER_CHECKS = [
    ("rms_norm fp32", lambda s: check_rms_norm((3, 256), F32, CPU, s)),
    ("rms_norm bf16 per head", lambda s: check_rms_norm((2, 4, 64), BF16, CPU, s)),
    ("rms_norm fp16 strided", lambda s: check_rms_norm((3, 256), F16, CPU, s, strided=True)),
    ("add_rms_norm fp32", lambda s: check_add_rms_norm((3, 256), F32, CPU, s)),
    ("add_rms_norm bf16", lambda s: check_add_rms_norm((2, 256), BF16, CPU, s)),
    ("gated_act silu fp32", lambda s: check_gated_act(3, 1100, "silu", F32, CPU, s)),
    ("gated_act gelu bf16", lambda s: check_gated_act(2, 300, "gelu", BF16, CPU, s)),
    ("gated_act gelu fp32", lambda s: check_gated_act(3, 1100, "gelu", F32, CPU, s)),
    ("sandwich_norm after attention bf16", lambda s: check_sandwich_norm(2, BF16, CPU, s, False, False, 1.0, 3)),
    ("sandwich_norm after the FFN fp32", lambda s: check_sandwich_norm(3, F32, CPU, s, True, True, 0.5, 1)),
    ("sandwich_norm last layer bf16", lambda s: check_sandwich_norm(2, BF16, CPU, s, True, True, 1.0, 0)),
    ("qk_norm_rope neox norm bf16", lambda s: check_qk_norm_rope(3, 2, 64, "neox", True, BF16, CPU, s)),
    ("qk_norm_rope neox fp32", lambda s: check_qk_norm_rope(2, 2, 64, "neox", False, F32, CPU, s)),
    ("qk_norm_rope q and k bf16", lambda s: check_qk_pair(3, 4, 2, "neox", True, BF16, CPU, s, head_dim=64)),
    ("qk_norm_rope q and k into the caches neox bf16", lambda s: check_qk_cache_write(5, 4, 2, "neox", BF16, CPU, s)),
    ("qk_norm_rope q and k into the caches normal fp32",
     lambda s: check_qk_cache_write(3, 6, 3, "normal", F32, CPU, s)),
    ("qk_norm_rope normal norm fp32", lambda s: check_qk_norm_rope(2, 3, 64, "normal", True, F32, CPU, s)),
    ("qk_norm_rope normal fp16 strided", lambda s: check_qk_norm_rope(2, 2, 32, "normal", False, F16, CPU, s,
                                                                      strided=True)),
    ("route_topk 60top4 norm masked fp32", lambda s: check_route_topk(3, 60, 4, True, True, F32, CPU, s)),
    ("route_topk 128top8 bf16", lambda s: check_route_topk(2, 128, 8, False, False, BF16, CPU, s)),
    ("route_topk 512top16 norm masked bf16", lambda s: check_route_topk(3, 512, 16, True, True, BF16, CPU, s)),
    ("routed_weights 60top4 norm masked bf16 i32",
     lambda s: check_routed_weights(3, 60, 4, True, True, BF16, torch.int32, CPU, s)),
    ("routed_weights 128top8 out of range fp32",
     lambda s: check_routed_weights(2, 128, 8, True, False, F32, torch.int64, CPU, s, out_of_range=True)),
]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
