"""Host memory shared by the link and the CPU (CUDA): how fast the device streams experts from pinned host memory
(copied inside the expert kernels, as a decode step's streamed misses are) and how fast the CPU expert kernel reads
them, each alone and both at once. Hybrid's bound `miss_bytes / (link + CPU)` holds only where the host memory feeds
both at once. Usage: python3 .ci/gpu-host-share.py [THREADS] [SECONDS]"""

import sys
import threading
import time

import torch

from engine.expert_cache.device import empty_bank
from ops.bank import ExpertWeights, random_expert_weights
from ops.cpu_experts import expert_ffn_cpu
from ops.quants import QType
from ops.triton import Fill, grouped_expert_ffn, tables_from_bank

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 14
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
EXPERTS, HIDDEN, FF, K = 384, 2048, 768, 8  # 1 GB a bank of Qwen3-30B-A3B's Q4_K experts
dev = torch.device("cuda")


def pinned_bank(seed: int) -> ExpertWeights:
    torch.manual_seed(seed)
    w = random_expert_weights(EXPERTS, HIDDEN, FF, QType.Q4_K)
    return ExpertWeights(w.gate.pin_memory(), w.up.pin_memory(), w.down.pin_memory(), w.gate_type, w.up_type,
                         w.down_type, w.hidden, w.ff)


link_bank, cpu_bank = pinned_bank(0), pinned_bank(1)  # separate memory: neither reads the other's cache lines
src = tables_from_bank(link_bank, dev)
dst = tables_from_bank(empty_bank(link_bank, EXPERTS, dev), dev)
fill = Fill(torch.ones(EXPERTS, dtype=torch.int8, device=dev), src)
x_dev = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
ones = torch.ones(K, device=dev)
tokens_dev = torch.zeros(K, dtype=torch.int64, device=dev)


def device_round(i: int) -> None:
    """K missed experts of one token streamed and computed, as a layer of a decode step does."""
    experts = (torch.arange(K, device=dev) + (i * K) % EXPERTS) % EXPERTS
    grouped_expert_ffn(x_dev, tokens_dev, experts, ones, dst, fill=fill)


def device_gbps(seconds: float, started: threading.Event | None = None) -> float:
    rounds = 0
    device_round(0)
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    if started is not None:
        started.set()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(16):
            device_round(rounds)
            rounds += 1
        torch.cuda.current_stream().synchronize()
    end.record()
    end.synchronize()
    return rounds * K * link_bank.expert_bytes / (begin.elapsed_time(end) / 1e3) / 1e9


def cpu_gbps(seconds: float) -> float:
    x, tokens, weights = torch.randn(1, HIDDEN), torch.zeros(K, dtype=torch.int64), torch.full((K,), 1.0 / K)
    rounds, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        experts = (torch.arange(K) + (rounds * K) % EXPERTS) % EXPERTS
        expert_ffn_cpu(x, tokens, experts, weights, cpu_bank, num_threads=THREADS)
        rounds += 1
    return rounds * K * cpu_bank.expert_bytes / (time.perf_counter() - began) / 1e9


def both(seconds: float) -> tuple[float, float]:
    result: list[float] = []
    started = threading.Event()
    worker = threading.Thread(target=lambda: result.append(device_gbps(seconds, started)))
    worker.start()
    started.wait()
    cpu = cpu_gbps(seconds * 0.9)  # inside the device's window
    worker.join()
    return result[0], cpu


print(f"host memory shared by the link and the CPU: {EXPERTS} Q4_K experts of {link_bank.expert_bytes / 1e6:.2f} MB "
      f"per side, CPU threads {THREADS}, {SECONDS:.1f} s a run", flush=True)
for run in range(2):
    link_alone = device_gbps(SECONDS)
    cpu_alone = cpu_gbps(SECONDS)
    link_both, cpu_both = both(SECONDS)
    print(f"run {run}: link alone {link_alone:.1f} GB/s, CPU alone {cpu_alone:.1f} GB/s "
          f"(sum {link_alone + cpu_alone:.1f}); at once: link {link_both:.1f} + CPU {cpu_both:.1f} "
          f"= {link_both + cpu_both:.1f} GB/s", flush=True)
