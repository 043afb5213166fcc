"""How `hybrid` mode splits a layer's missed experts between the device (copying them from pinned host
memory, `ops.triton.stage`) and the CPU, so both finish at about the same time. With n missed experts of
B bytes, the device streams s of them in s B / link; the CPU computes the rest in c + (n - s) B / cpu,
where c is the fixed cost of the layer's CPU task (its start and join, as the device waits for them).
Equal times give s = share n + lead, share = link / (link + CPU) and lead = c / (B / link + B / CPU): the
device streams the first `share x n + lead` of a layer's missed experts, in pair order (`ops.cache_step`),
so a layer with few misses streams them all. The engine re-measures the CPU as it runs (`CpuTasks.work`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.config import MissMode
from engine.expert_cache.cpu_tasks import CpuTasks, CpuWork
from engine.expert_cache.device import empty_bank
from ops.bank import ExpertWeights
from ops.cpu_experts import expert_ffn_cpu


def _seconds(fn: Callable[[], None], repeats: int = 3) -> float:
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
    """The CPU expert kernel on `num_experts` of the bank's experts, one token: expert bytes per second."""
    experts = torch.arange(min(num_experts, bank.gate.shape[0]))
    x = torch.randn(1, bank.hidden)
    tokens, weights = torch.zeros_like(experts), torch.full((len(experts),), 1.0 / len(experts))
    def run() -> None:
        expert_ffn_cpu(x, tokens, experts, weights, bank)

    seconds = _seconds(run)
    return len(experts) * bank.expert_bytes / seconds / 1e9


def measure_stream_gbps(bank: ExpertWeights, device: torch.device, num_experts: int = 8) -> float:
    """The device's own speed on missed experts, as a decode step computes them: copied from pinned host
    memory into VRAM inside the grouped FFN's kernels."""
    from ops.triton import Fill, grouped_expert_ffn, tables_from_bank

    n = min(num_experts, bank.num_experts)
    first = ExpertWeights(bank.gate[:n], bank.up[:n], bank.down[:n], bank.gate_type, bank.up_type,
                          bank.down_type, bank.hidden, bank.ff)  # plain math: the copy speed is measured
    src, dst = tables_from_bank(first, device), tables_from_bank(empty_bank(first, n, device), device)
    fill = Fill(torch.ones(n, dtype=torch.int8, device=device), src)
    experts = torch.arange(n, device=device)
    x = torch.randn(1, bank.hidden, device=device, dtype=torch.bfloat16)
    tokens, weights = torch.zeros_like(experts), torch.full((n,), 1.0, device=device)

    def run() -> None:
        grouped_expert_ffn(x, tokens, experts, weights, dst, fill=fill)
        torch.cuda.synchronize(device)

    return n * first.expert_bytes / _seconds(run) / 1e9


def cpu_task_costs(tasks: CpuTasks, layer: int, top_k: int) -> tuple[float, float]:
    """(fixed, per expert) seconds of a layer's CPU task as the device waits for it (CUDA, a ringing device)."""
    one = tasks.device_seconds(layer, 1)
    if top_k < 2:
        return 0.0, one
    several = min(top_k, 4)
    per = max((tasks.device_seconds(layer, several) - one) / (several - 1), 1e-7)
    return max(one - per, 0.0), per


UPLOAD_LINK_BUSY = 0.25  # hybrid uploads the CPU's misses while streamed misses keep the link busier than this


class LinkLoad:
    """The share of the time the host link spends on streamed misses: their bytes over the link's measured rate,
    per second of decode steps (averages over the last ~`steps` steps)."""

    def __init__(self, link_gbps: float, steps: int = 16) -> None:
        self.link_gbps, self.decay = link_gbps, 1.0 - 1.0 / steps
        self._bytes = self._seconds = 0.0

    def add(self, streamed_bytes: int, seconds: float) -> None:
        self._bytes = self._bytes * self.decay + streamed_bytes
        self._seconds = self._seconds * self.decay + seconds

    @property
    def busy(self) -> float:
        if self._seconds <= 0 or self.link_gbps <= 0:
            return 0.0
        return self._bytes / (self.link_gbps * 1e9) / self._seconds


class Split:
    """The split of hybrid mode (module doc): `share` and `lead`, from the link and the CPU measured at start
    (the CPU task's fixed cost on CUDA with a ringing device, else none); the CPU's rate then re-measured from
    the tasks' own counters every `every` decode steps. Stream mode streams every miss (share 1), cpu mode
    none (share 0). `link`: how busy streamed misses keep the link, for `uploads_cpu_misses`."""

    def __init__(self, mode: MissMode, device: torch.device, bank: ExpertWeights | None, on_device: bool,
                 every: int = 64, link_cap_gbps: float | None = None, cpu: CpuTasks | None = None) -> None:
        self.every, self.link_gbps, self.cpu_gbps, self.fixed_seconds = every, 0.0, 0.0, 0.0
        self.expert_bytes = bank.expert_bytes if bank is not None else 0
        self.lead = 0.0
        self._steps = 0
        self._last: CpuWork | None = None
        if not mode.uses_cpu:
            self.share = 1.0
        elif not mode.streams or bank is None:
            self.share = 0.0
        else:
            self.link_gbps = measure_stream_gbps(bank, device) if on_device else measure_link_gbps(device)
            self.link_gbps = min(self.link_gbps, link_cap_gbps or self.link_gbps)
            if on_device and cpu is not None and cpu.rings:
                top_k = cpu.job.expert_ids.shape[0] // cpu.job.x.shape[0]
                self.fixed_seconds, per = cpu_task_costs(cpu, next(iter(cpu.tasks)), top_k)
                self.cpu_gbps = bank.expert_bytes / per / 1e9
            else:
                self.cpu_gbps = measure_cpu_gbps(bank)
            self.share, self.lead = self._split()
        self.link = LinkLoad(self.link_gbps)

    @property
    def uploads_cpu_misses(self) -> bool:
        """Hybrid: promote the experts the CPU computed by uploads (they never crossed the link), while the
        streamed misses leave the link mostly idle. A CPU-computed expert does not land, so its next use misses
        again: at a 50% budget each costs about one later miss, at 25% 0.2 (replaying bench's requests:
        tests/engine/expert_cache/test_cache_replay.py), where the uploads would share a link the step waits on
        (docs/benchmarks.md)."""
        return self.is_hybrid and self.link.busy < UPLOAD_LINK_BUSY

    def _split(self) -> tuple[float, float]:
        share = self.link_gbps / (self.link_gbps + self.cpu_gbps)
        expert_seconds = self.expert_bytes / (self.link_gbps * 1e9) + self.expert_bytes / (self.cpu_gbps * 1e9)
        return share, self.fixed_seconds / expert_seconds

    @property
    def is_hybrid(self) -> bool:
        return 0.0 < self.share < 1.0

    def update(self, work: CpuWork) -> tuple[float, float] | None:
        """After a decode step: the new (share, lead) when the CPU's measured rate moved the share by more than
        2 points."""
        if not self.is_hybrid:
            return None
        self._steps += 1
        if self._last is None or self._steps % self.every:
            self._last = self._last or work
            return None
        busy, moved = work.busy_seconds - self._last.busy_seconds, work.bytes - self._last.bytes
        self._last = work
        if busy <= 0 or moved <= 0:
            return None
        self.cpu_gbps = moved / busy / 1e9
        share, lead = self._split()
        if abs(share - self.share) <= 0.02:
            return None
        self.share, self.lead = share, lead
        return share, lead
