"""Multi-head latent attention's decode projections (`ops.triton.mla`) against torch written out here: the query's
nope part times k_b, its rope part rotated and scaled, the latent RMS-normed and the shared key rotated into the
latent cache at each token's slot and position (nothing else of the cache written), and the latent output
decompressed by v_b.

Fresh random inputs every run. The kernels compute in float32 and round once; the reference rounds after each op.
Errors are relative to the largest reference value of the compared part: float32 within 1e-5, bf16 within 2e-2
(two bf16 ulps at the top of a row that cancels). The CUDA tests carry `@pytest.mark.gpu`; without CUDA the same
checks run under Triton's interpreter in a subprocess.
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine.model import rope_frequencies
from ops.fused import qk_norm_rope_torch, rms_norm_torch

triton = pytest.importorskip("triton", reason="triton is not installed: the fused GPU kernels need it")

from ops.triton.mla import mla_out, mla_qk  # noqa: E402
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6
F32, BF16, CPU, CUDA = torch.float32, torch.bfloat16, torch.device("cpu"), torch.device("cuda")


def fresh_seed() -> int:
    return int(torch.randint(1 << 30, ()))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def check_qk(tokens: int, heads: int, nope: int, rank: int, rope: int, style: str, gain: float, dtype: torch.dtype,
             device: torch.device, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    q_rows = heads * (nope + rope)
    # q and kv as views of one projection's rows (their row stride that of the whole)
    proj = torch.randn(tokens, q_rows + rank + rope, generator=gen).to(dtype)
    q, kv = proj[:, :q_rows].view(tokens, heads, nope + rope), proj[:, q_rows:]
    k_b = (torch.randn(heads, rank, nope, generator=gen) / nope ** 0.5).to(dtype)
    kv_norm = (torch.rand(rank, generator=gen) + 0.5).to(dtype)
    slots, max_len = max(4, tokens), 64  # a slot per token: the (slot, position) pairs are distinct
    slot_ids = torch.randperm(slots, generator=gen)[:tokens]
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    freqs = rope_frequencies(rope, 10000.0, 1.0, CPU)
    cache = torch.randn(slots, 1, max_len, rank + rope, generator=gen).to(dtype)
    before = cache.clone()

    got_cache = cache.to(device)
    got = mla_qk(q.to(device), proj.to(device)[:, q_rows:], k_b.to(device), kv_norm.to(device), positions.to(device),
                 freqs.to(device), style, EPS, gain, got_cache, slot_ids.to(device))  # type: ignore[arg-type]

    f = lambda t: t.float()  # noqa: E731
    q_nope, q_rot = f(q).split([nope, rope], dim=-1)
    want_q = torch.cat([torch.einsum("nhd,hrd->nhr", q_nope, f(k_b)),
                        qk_norm_rope_torch(q_rot, None, positions, freqs, style, EPS) * gain], dim=-1)  # type: ignore[arg-type]
    want_cache = f(before)
    want_cache[slot_ids, 0, positions] = torch.cat(
        [rms_norm_torch(f(kv[:, :rank]), f(kv_norm), EPS),
         qk_norm_rope_torch(f(kv[:, None, rank:]), None, positions, freqs, style, EPS)[:, 0]], dim=-1)  # type: ignore[arg-type]
    assert got.shape == (tokens, heads, rank + rope) and got.dtype == dtype
    untouched = torch.ones(slots, max_len, dtype=torch.bool)
    untouched[slot_ids, positions] = False
    assert torch.equal(got_cache.cpu()[untouched[:, None].expand(-1, 1, -1)], before[untouched[:, None]])
    errors = [relative_error(got[..., :rank].cpu(), want_q[..., :rank]),
              relative_error(got[..., rank:].cpu(), want_q[..., rank:]),
              relative_error(got_cache.cpu()[slot_ids, 0, positions, :rank], want_cache[slot_ids, 0, positions, :rank]),
              relative_error(got_cache.cpu()[slot_ids, 0, positions, rank:], want_cache[slot_ids, 0, positions, rank:])]
    assert max(errors) < TOL[dtype], errors
    return max(errors)


def check_out(tokens: int, heads: int, rank: int, v_dim: int, dtype: torch.dtype, device: torch.device,
              seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    v_b = (torch.randn(heads, v_dim, rank, generator=gen) / rank ** 0.5).to(dtype)
    got = mla_out(x.to(device), v_b.to(device))
    want = torch.einsum("nhr,hvr->nhv", x.float(), v_b.float()).reshape(tokens, heads * v_dim)
    assert got.shape == (tokens, heads * v_dim) and got.dtype == dtype
    error = relative_error(got.cpu(), want)
    assert error < TOL[dtype], error
    return error


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_qk_at_deepseek_v2_lites_shapes(tokens: int, dtype: torch.dtype) -> None:
    check_qk(tokens, 16, 128, 512, 64, "normal", 1.0, dtype, CUDA, fresh_seed())
    check_qk(tokens, 16, 128, 512, 64, "normal", 1.3, dtype, CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_out_at_deepseek_v2_lites_shapes(tokens: int, dtype: torch.dtype) -> None:
    check_out(tokens, 16, 512, 128, dtype, CUDA, fresh_seed())


def check_refusals(device: torch.device, seed: int) -> None:
    """Shapes that do not fit are a ValueError naming the argument, before any launch."""
    q, kv = torch.zeros(2, 4, 48, device=device), torch.zeros(2, 48, device=device)
    with pytest.raises(ValueError, match="kv: expected"):  # kv's rope part (16) must be q's (48 - 32)
        mla_qk(q, kv, torch.zeros(4, 40, 32, device=device), torch.ones(40, device=device),
               torch.arange(2, device=device), torch.ones(8, device=device), "normal", EPS, 1.0,
               torch.zeros(2, 1, 8, 48, device=device), torch.arange(2, device=device))
    with pytest.raises(ValueError, match="v_b"):  # v_b's rank (48) must be x's (32)
        mla_out(torch.zeros(2, 4, 32, device=device), torch.zeros(4, 16, 48, device=device))


@pytest.mark.gpu
def test_shapes_that_do_not_fit_are_refused() -> None:
    check_refusals(CUDA, 0)


def test_cpu_tensors_need_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        mla_out(torch.zeros(1, 2, 8), torch.zeros(2, 4, 8))


INTERPRETER_CHECKS = [
    ("mla_qk normal fp32", lambda s: check_qk(3, 2, 32, 96, 16, "normal", 1.0, F32, CPU, s)),
    ("mla_qk neox gain bf16, odd sizes", lambda s: check_qk(2, 3, 24, 40, 12, "neox", 1.25, BF16, CPU, s)),
    ("mla_out fp32", lambda s: check_out(3, 2, 96, 40, F32, CPU, s)),
    ("mla_out bf16", lambda s: check_out(2, 3, 40, 24, BF16, CPU, s)),
    ("refusals", lambda s: check_refusals(CPU, s)),
]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
