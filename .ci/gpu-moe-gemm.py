"""The fused prefill expert GEMMs (`ops.triton.moe_gemm`) against the dequantize + grouped GEMM path
(`ops.grouped_gemm`) on one Qwen3-30B-A3B layer (128 experts, gate/up [768 x 2048], down [2048 x 768]; Q4_K
gate/up with Q4_K or Q6_K down, as in Q4_K_M files) at 512 and 2048 tokens x top-8: median milliseconds of
`repeats` runs (CUDA events), the layer's tokens/s, the relative difference of the two outputs, and a sweep of
the fused kernels' tiles. Decides `MOECACHE_PREFILL_EXPERTS`'s default.
Usage: python3 .ci/gpu-moe-gemm.py [repeats]  (needs CUDA)"""

import os
import statistics
import sys
from collections.abc import Callable

import torch

from ops import quants
from ops.bank import ExpertWeights
from ops.grouped_gemm import PREFILL_EXPERTS, expert_ffn_grouped_gemm
from ops.quants import QType
from ops.triton.moe_gemm import MoeGemmConfig, expert_ffn_moe_gemm

HIDDEN, FF, EXPERTS, TOP_K = 2048, 768, 128, 8
CUDA = torch.device("cuda")
SWEEP = [MoeGemmConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s)
         for m in (None, 32, 64) for n, k, w in ((64, 64, 8), (64, 128, 8), (128, 64, 8), (64, 64, 4))
         for s in (2, 3)]


def bank(down_type: QType) -> ExpertWeights:
    generator = torch.Generator().manual_seed(0)

    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, EXPERTS * rows * blocks, generator).view(EXPERTS, rows, -1).to(CUDA)

    return ExpertWeights(projection(QType.Q4_K, FF, HIDDEN), projection(QType.Q4_K, FF, HIDDEN),
                         projection(down_type, HIDDEN, FF), QType.Q4_K, QType.Q4_K, down_type, HIDDEN, FF)


def routing(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = torch.rand(num_tokens, EXPERTS, device=CUDA)
    rows = scores.topk(TOP_K, dim=1).indices.flatten()
    tokens = torch.arange(num_tokens, device=CUDA).repeat_interleave(TOP_K)
    return tokens, rows, torch.rand(rows.shape, device=CUDA)


def median_ms(run: Callable[[], torch.Tensor], repeats: int) -> float:
    run()  # compile, warm the allocator
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(layer: ExpertWeights, num_tokens: int, repeats: int) -> None:
    x = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
    pairs = routing(num_tokens)
    dequant = median_ms(lambda: expert_ffn_grouped_gemm(x, *pairs, layer), repeats)
    fused = median_ms(lambda: expert_ffn_moe_gemm(x, *pairs, layer), repeats)
    a, b = expert_ffn_grouped_gemm(x, *pairs, layer), expert_ffn_moe_gemm(x, *pairs, layer)
    difference = ((a - b).norm() / a.norm()).item()
    print(f"Q4_K/{layer.down_type.name} down, {num_tokens} tokens: dequant {dequant:.3f} ms, fused {fused:.3f} ms "
          f"({num_tokens / fused * 1e3:,.0f} tok/s a layer), x{dequant / fused:.2f}, "
          f"relative difference {difference:.1e}", flush=True)
    sweep = [(median_ms(lambda c=c: expert_ffn_moe_gemm(x, *pairs, layer, c), repeats), c) for c in SWEEP]
    for ms, config in sorted(sweep, key=lambda s: s[0])[:3]:
        print(f"    {ms:.3f} ms  {config}", flush=True)


def main(repeats: int) -> None:
    os.environ[PREFILL_EXPERTS] = "dequant"  # expert_ffn_grouped_gemm: the dequantize path
    for down_type in (QType.Q4_K, QType.Q6_K):
        layer = bank(down_type)
        for num_tokens in (512, 2048):
            compare(layer, num_tokens, repeats)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs CUDA"
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
