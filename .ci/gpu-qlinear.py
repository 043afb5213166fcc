"""Dense products kept as Q8_0 (`ops.triton.qlinear`) against the bf16 copies they replace (`F.linear`, cuBLAS) at
Qwen3-30B-A3B's attention and output shapes and Gemma 4's dense MLP, at a decode step's and a prompt's rows: each a
CUDA graph of one product with each of LAYERS distinct matrices (together past the 50 MB L2, as a step reads
them), microseconds a product, the median of `repeats` replays; the achieved read rate of W beside each.
QLINEAR_CONFIGS: more configs, block_m:block_n:block_k:splits:warps:stages:w_left each, comma-separated.
Usage: python3 .ci/gpu-qlinear.py [repeats=10]  (needs CUDA)"""

import os
import statistics
import sys

import torch
import torch.nn.functional as F

from ops import quants
from ops.quants import QType
from ops.qweight import Q8Weight
from ops.triton.qlinear import Q8LinearConfig, default_config, q8_linear

CUDA = torch.device("cuda")
LAYERS = 12
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "output": (151936, 2048), "gemma gate_up": (4224, 2816),
          "gemma down": (2816, 2112)}
ROWS = (1, 8, 32, 512)


def graph_us(calls: list, repeats: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def main(repeats: int) -> None:
    extra = [Q8LinearConfig(*(int(v) for v in spec.split(":")[:6]), w_left=spec.split(":")[6] == "1")
             for spec in filter(None, os.environ.get("QLINEAR_CONFIGS", "").split(","))]
    generator = torch.Generator(device=CUDA).manual_seed(0)
    print(f"{'matrix':<14} {'rows':>5} {'bf16 us':>8} {'q8 us':>8} {'q8/bf16':>8} {'q8 GB/s':>8}  default config; "
          f"extra configs us", flush=True)
    for name, (n, k) in SHAPES.items():
        layers = min(LAYERS, max(1, 4 * 10**9 // (3 * n * k)))  # the output matrix: fewer copies
        q8 = [Q8Weight.from_gguf(quants.random_blocks(QType.Q8_0, n * k // 32, generator), (n, k), CUDA)
              for _ in range(layers)]
        bf16 = [w.dequantize(torch.bfloat16) for w in q8]
        for rows in ROWS:
            if name == "output" and rows > 32:
                continue
            x = torch.randn(rows, k, device=CUDA, generator=generator).bfloat16()
            base = graph_us([lambda w=w, x=x: F.linear(x, w) for w in bf16], repeats)
            ours = graph_us([lambda w=w, x=x: q8_linear(x, w) for w in q8], repeats)
            others = [graph_us([lambda w=w, c=c, x=x: q8_linear(x, w, config=c) for w in q8], repeats) for c in extra]
            error = ((q8_linear(x, q8[0]).float() - F.linear(x, bf16[0]).float()).norm()
                     / F.linear(x, bf16[0]).float().norm()).item()
            print(f"{name:<14} {rows:>5} {base:>8.1f} {ours:>8.1f} {ours / base:>8.2f} "
                  f"{q8[0].nbytes / ours / 1e3:>8.0f}  {default_config(rows, n, k)} err {error:.1e}; "
                  + " ".join(f"{t:.1f}" for t in others), flush=True)
        del q8, bf16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs CUDA"
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
