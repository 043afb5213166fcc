"""CPU expert kernel speed by memory kind (pageable / pinned) and calling thread (main / pool)."""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ops.bank import ExpertWeights, random_expert_weights
from ops.cpu_experts import expert_ffn_cpu
from ops.quants import QType


def pinned(w: ExpertWeights) -> ExpertWeights:
    pin = lambda t: t.pin_memory() if torch.cuda.is_available() else t.clone()  # noqa: E731
    return ExpertWeights(pin(w.gate), pin(w.up), pin(w.down), w.gate_type, w.up_type, w.down_type, w.hidden, w.ff)


def gbps(w: ExpertWeights, call) -> float:  # noqa: ANN001
    x, tokens = torch.randn(1, w.hidden), torch.zeros(8, dtype=torch.long)
    times = []
    for _ in range(40):
        experts = torch.randperm(w.gate.shape[0])[:8]
        start = time.perf_counter()
        call(lambda experts=experts: expert_ffn_cpu(x, tokens, experts, torch.full((8,), 0.125), w))
        times.append(time.perf_counter() - start)
    return 8 * w.expert_bytes / sorted(times)[20] / 1e9


pool = ThreadPoolExecutor(1)
for name, w in (("pageable", random_expert_weights(128, 2048, 768, QType.Q4_K)),):
    for kind, bank in ((name, w), ("pinned", pinned(w))):
        print(kind, "main thread", round(gbps(bank, lambda f: f()), 1), "GB/s;",
              "pool thread", round(gbps(bank, lambda f: pool.submit(f).result()), 1), "GB/s", flush=True)
