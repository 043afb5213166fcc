"""The prefill expert FFN (`ops.grouped_gemm`: dequantize to bf16/f32, grouped GEMM) against the torch
reference `expert_ffn_reference`, on fresh random GGUF blocks every run. On the CPU in float32 (tight);
on CUDA in bf16 with the Triton dequantization (`@pytest.mark.gpu`)."""

from __future__ import annotations

import pytest
import torch

from ops import quants
from ops.bank import ExpertWeights
from ops.cpu_experts import QType
from ops.expert_ffn import expert_ffn_reference
from ops.grouped_gemm import expert_ffn_grouped_gemm, grouped_gemm_available

pytestmark = pytest.mark.skipif(not grouped_gemm_available(torch.device("cpu")), reason="torch has no _grouped_mm")


def random_bank(types: tuple[QType, QType, QType], num_experts: int, hidden: int, ff: int,
                generator: torch.Generator) -> ExpertWeights:
    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, num_experts * rows * blocks, generator).view(num_experts, rows, -1)

    return ExpertWeights(projection(types[0], ff, hidden), projection(types[1], ff, hidden),
                         projection(types[2], hidden, ff), *types, hidden, ff)


def random_routing(num_tokens: int, num_experts: int, top_k: int, unused: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids, weights `[tokens, top_k]`: distinct experts per token, the last `unused` experts never
    chosen, about 1 in 8 entries -1."""
    scores = torch.rand(num_tokens, num_experts - unused, generator=generator)
    expert_ids = scores.topk(top_k, dim=1).indices
    expert_ids = torch.where(torch.rand(expert_ids.shape, generator=generator) < 1 / 8, -1, expert_ids)
    return expert_ids, torch.rand(expert_ids.shape, generator=generator)


def pairs(expert_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[tokens, top_k]` routing -> token_ids, bank rows, weights `[pairs]`."""
    tokens = torch.arange(expert_ids.shape[0], device=expert_ids.device).repeat_interleave(expert_ids.shape[1])
    return tokens, expert_ids.flatten(), weights.flatten()


def reference(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, bank: ExpertWeights) -> torch.Tensor:
    return expert_ffn_reference(x, *pairs(expert_ids, weights), bank)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


TYPES = [(QType.Q4_K,) * 3, (QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q5_K, QType.Q8_0, QType.IQ4_XS)]


@pytest.mark.parametrize("types", TYPES, ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["one-expert-chunks", "one-chunk"])
def test_matches_reference_on_cpu(types: tuple[QType, QType, QType], chunk_bytes: int) -> None:
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    bank = random_bank(types, num_experts=6, hidden=256, ff=256, generator=generator)
    expert_ids, weights = random_routing(40, 6, 2, unused=1, generator=generator)
    x = torch.randn(40, 256, generator=generator)
    out = expert_ffn_grouped_gemm(x, *pairs(expert_ids, weights), bank, dtype=torch.float32, chunk_bytes=chunk_bytes)
    assert relative_error(out, reference(x, expert_ids, weights, bank)) < 1e-5


def test_no_selected_expert_gives_zeros() -> None:
    generator = torch.Generator().manual_seed(0)
    bank = random_bank((QType.Q4_K,) * 3, num_experts=2, hidden=256, ff=256, generator=generator)
    out = expert_ffn_grouped_gemm(torch.randn(3, 256), *pairs(torch.full((3, 2), -1), torch.ones(3, 2)), bank,
                                  dtype=torch.float32)
    assert out.shape == (3, 256) and not out.any()


def test_pairs_in_any_order_and_number_per_token() -> None:
    generator = torch.Generator().manual_seed(2)
    bank = random_bank((QType.Q4_K,) * 3, num_experts=5, hidden=256, ff=256, generator=generator)
    token_ids = torch.randint(0, 7, (23,), generator=generator)  # token 0 .. 6, some with no pair
    rows = torch.randint(-1, 5, (23,), generator=generator)
    weights = torch.rand(23, generator=generator)
    x = torch.randn(7, 256, generator=generator)
    out = expert_ffn_grouped_gemm(x, token_ids, rows, weights, bank, dtype=torch.float32)
    assert relative_error(out, expert_ffn_reference(x, token_ids, rows, weights, bank)) < 1e-5


def test_same_bits_every_run() -> None:
    generator = torch.Generator().manual_seed(1)
    bank = random_bank((QType.Q4_K,) * 3, num_experts=4, hidden=256, ff=256, generator=generator)
    expert_ids, weights = random_routing(33, 4, 2, unused=0, generator=generator)
    x = torch.randn(33, 256, generator=generator)
    runs = [expert_ffn_grouped_gemm(x, *pairs(expert_ids, weights), bank, dtype=torch.float32, chunk_bytes=1)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("types", TYPES, ids=lambda t: "-".join(q.name for q in t))
def test_bf16_matches_reference_on_cuda(types: tuple[QType, QType, QType]) -> None:
    pytest.importorskip("triton", reason="the CUDA path dequantizes with Triton")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    bank = random_bank(types, num_experts=16, hidden=512, ff=256, generator=generator)
    expert_ids, weights = random_routing(300, 16, 4, unused=3, generator=generator)
    x = torch.randn(300, 512, generator=generator).bfloat16()
    ref = reference(x, expert_ids, weights, bank)
    cuda_bank = ExpertWeights(bank.gate.to(device), bank.up.to(device), bank.down.to(device), *types, 512, 256)
    out = expert_ffn_grouped_gemm(x.to(device), *pairs(expert_ids.to(device), weights.to(device)), cuda_bank,
                                  chunk_bytes=3 * 256 * 512 * 2 * 5)  # 5 experts a chunk
    # bf16 weights and activations into float32 accumulators: ~3 significant digits per product
    assert relative_error(out, ref) < 2e-2
