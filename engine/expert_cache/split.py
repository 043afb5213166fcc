"""How `hybrid` mode splits a step's missed experts between the device (reading host memory over PCIe)
and the CPU: in proportion to the two measured speeds, so both finish at about the same time."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.expert_cache.device import empty_bank
from ops.cpu_experts import ExpertWeights, expert_ffn_cpu


@dataclass(frozen=True)
class MissSplit:
    stream_share: float  # share of missed experts the device reads from host memory
    link_gbps: float = 0.0  # host -> device read speed
    cpu_gbps: float = 0.0  # CPU expert compute speed, counted in expert bytes

    def streamed(self, missed: torch.Tensor) -> torch.Tensor:
        """missed: expert id of every missed pair (host) -> the experts the device reads: the ones with
        most tokens first (the device gains most from reusing an expert across tokens)."""
        experts, counts = missed.unique(return_counts=True)
        num = round(self.stream_share * len(experts))
        return experts[torch.argsort(counts, descending=True, stable=True)[:num]].sort().values


def _seconds(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_link_gbps(device: torch.device, num_bytes: int = 64 << 20) -> float:
    """Pinned host -> device copy speed (a host memory copy when the device is the CPU)."""
    pin = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)

    return num_bytes / _seconds(copy) / 1e9


def measure_cpu_gbps(bank: ExpertWeights, num_experts: int = 8) -> float:
    experts = torch.arange(min(num_experts, bank.gate.shape[0]))
    x = torch.randn(1, bank.hidden)
    tokens, weights = torch.zeros_like(experts), torch.full((len(experts),), 1.0 / len(experts))
    per_expert = sum(t[0].numel() for t in (bank.gate, bank.up, bank.down))
    seconds = _seconds(lambda: expert_ffn_cpu(x, tokens, experts, weights, bank))
    return len(experts) * per_expert / seconds / 1e9


def measure_stream_gbps(bank: ExpertWeights, device: torch.device, num_experts: int = 8) -> float:
    """The device's own speed on missed experts, as a decode step computes them: copied from pinned host
    memory into VRAM staging rows (`ops.triton.stage`), then the grouped kernel."""
    from ops.triton import grouped_expert_ffn, stage_experts, tables_from_bank

    n = min(num_experts, bank.num_experts)
    first = ExpertWeights(bank.gate[:n], bank.up[:n], bank.down[:n], bank.gate_type, bank.up_type,
                          bank.down_type, bank.hidden, bank.ff)
    src, dst = tables_from_bank(first, device), tables_from_bank(empty_bank(first, n, device), device)
    experts = torch.arange(n, device=device)
    x = torch.randn(1, bank.hidden, device=device, dtype=torch.bfloat16)
    tokens, weights = torch.zeros_like(experts), torch.full((n,), 1.0, device=device)

    def run() -> None:
        stage_experts(experts, src, dst)
        grouped_expert_ffn(x, tokens, experts, weights, dst)
        torch.cuda.synchronize(device)

    return n * first.expert_bytes / _seconds(run) / 1e9


def measure_split(mode: str, device: torch.device, bank: ExpertWeights | None, zero_copy: bool = False) -> MissSplit:
    """`zero_copy`: the device reads misses through pointer tables and stages them itself (else the host
    stages copies)."""
    if mode != "hybrid" or bank is None:
        return MissSplit(1.0 if mode == "stream" else 0.0)
    link = measure_stream_gbps(bank, device) if zero_copy else measure_link_gbps(device)
    cpu = measure_cpu_gbps(bank)
    return MissSplit(link / (link + cpu), link, cpu)
