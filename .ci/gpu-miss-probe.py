"""What a streamed miss costs a decode layer (CUDA): 48 layers of one token's 8 experts (Qwen3-30B-A3B's Q4_K
experts), m of them copied from pinned host memory inside the expert kernels (`ops.triton.stage`), the rest read from
VRAM, captured in one CUDA graph as a decode step is. Prints the step's time per layer for m = 0, 1, 2, 4 and the cost
of a miss, for each copy block (bytes a program has in flight per iteration). Usage: python3 .ci/gpu-miss-probe.py"""

import torch

import ops.triton.down as down
import ops.triton.gate_up as gate_up
from engine.expert_cache.device import empty_bank
from ops.bank import ExpertWeights, random_expert_weights
from ops.quants import QType
from ops.triton import Fill, grouped_expert_ffn, tables_from_bank

EXPERTS, HIDDEN, FF, K, LAYERS = 384, 2048, 768, 8, 48
dev = torch.device("cuda")
torch.manual_seed(0)
w = random_expert_weights(EXPERTS, HIDDEN, FF, QType.Q4_K)
host = ExpertWeights(w.gate.pin_memory(), w.up.pin_memory(), w.down.pin_memory(), w.gate_type, w.up_type,
                     w.down_type, w.hidden, w.ff)
vram = empty_bank(host, EXPERTS, dev)
for name in ("gate", "up", "down"):
    getattr(vram, name).copy_(getattr(host, name))  # hits read real experts
tables, source = tables_from_bank(vram, dev), tables_from_bank(host, dev)
x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
tokens, weights = torch.zeros(K, dtype=torch.int64, device=dev), torch.full((K,), 1.0 / K, device=dev)
out = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(1)
layer_experts = [torch.randperm(EXPERTS, generator=g)[:K].to(dev) for _ in range(LAYERS)]


def step_ms(misses: int) -> float:
    """One captured step of LAYERS layers, each with `misses` of its 8 experts streamed; the median replay."""
    flags = [torch.zeros(EXPERTS, dtype=torch.int8, device=dev) for _ in range(LAYERS)]
    for f, experts in zip(flags, layer_experts):
        f[experts[:misses]] = 1
    fills = [Fill(f, source) for f in flags]
    for layer in range(LAYERS):  # compile outside the capture
        grouped_expert_ffn(x, tokens, layer_experts[layer], weights, tables, out, fill=fills[layer])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            grouped_expert_ffn(x, tokens, layer_experts[layer], weights, tables, out, fill=fills[layer])
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


for block in (4096, 8192, 16384):
    gate_up.COPY_BLOCK = down.COPY_BLOCK = block
    base = step_ms(0)
    row = [f"copy block {block:5d}: no miss {base / LAYERS * 1e3:.1f} us a layer"]
    for m in (1, 2, 4):
        t = step_ms(m)
        per = (t - base) / LAYERS / m * 1e3
        row.append(f"{m} miss{'es' if m > 1 else ''} {t / LAYERS * 1e3:.1f} us (+{per:.1f} us a miss, "
                   f"{host.expert_bytes / per / 1e3:.1f} GB/s)")
    print("; ".join(row), flush=True)
