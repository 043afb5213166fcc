"""The CPU's share of each host layer's experts (cpu and hybrid miss modes).

The device writes the layer's CPU job (the MoE input rows, the routing, which pairs are the CPU's:
`ops.cache_step.assign_experts`) into pinned memory shared by the layers; the layer's task computes
those pairs from the experts in host RAM into the job's output, which the device adds to its own
experts' sum. On CUDA, with native tasks, the kernel that writes the job rings a doorbell in pinned
memory and a native watcher thread runs the task (`ops.cpu_experts.BellWatcher`); the device computes
the hits meanwhile and waits for the answer before it adds the output (`ops.triton.bell`): no Python,
no host sync and no CUDA call on the host, so the step stays one CUDA graph. On a CPU device the same
task runs in place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.expert_cache.ram_tier import RamTier
from ops.bank import ExpertWeights
from ops.cache_step import Bell, CpuJob
from ops.cpu_experts import BellWatcher, ExpertTask, TaskCounters, expert_ffn_cpu, load_native

# NOTE: a decode step rings every ~100 us: the watcher and the pool's workers spin this long after a task
# before they sleep (the pool's default is 200 us), so the next layer's task starts at once
DECODE_SPIN_US = 2000


class Task(Protocol):
    def run(self) -> None: ...

    @property
    def counters(self) -> TaskCounters: ...


class PythonTask:
    """A layer's CPU pairs through `expert_ffn_cpu` (expert types or an activation the native task lacks, or no C
    compiler): the same job and result, run from Python only (such steps are not captured)."""

    def __init__(self, bank: ExpertWeights, job: CpuJob, num_threads: int) -> None:
        self.bank, self.job, self.num_threads = bank, job, num_threads
        self._counts = [0, 0, 0, 0, 0]  # calls, pairs, experts, bytes, busy ns

    def run(self) -> None:
        start = time.perf_counter_ns()
        job, top_k = self.job, self.job.expert_ids.shape[0] // self.job.x.shape[0]
        num_tokens = int(job.num_tokens[0])
        pairs = ((job.on_cpu[:num_tokens * top_k] != 0) & (job.expert_ids[:num_tokens * top_k] >= 0)).nonzero()[:, 0]
        experts = job.expert_ids[pairs].long()
        job.out[:num_tokens] = self._ffn(job.x[:num_tokens], pairs // top_k, experts, job.weights[pairs])
        distinct = int(experts.unique().numel())
        for i, n in enumerate((1, len(pairs), distinct, distinct * self.bank.expert_bytes,
                               time.perf_counter_ns() - start)):
            self._counts[i] += n

    def _ffn(self, x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        return expert_ffn_cpu(x, token_ids, expert_ids, weights, self.bank, num_threads=self.num_threads)

    @property
    def counters(self) -> TaskCounters:
        calls, pairs, experts, moved, busy = self._counts
        return TaskCounters(calls, pairs, experts, moved, busy, 0)


class TierTask(PythonTask):
    """A disk layer's CPU pairs (`--ssd-moe`): their experts read through the host-RAM tier, computed from its slots.
    `bank`: the layer's map views, for their sizes only."""

    def __init__(self, layer: int, tier: RamTier, bank: ExpertWeights, job: CpuJob, num_threads: int) -> None:
        super().__init__(bank, job, num_threads)
        self.layer, self.tier = layer, tier

    def _ffn(self, x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        return self.tier.ffn(self.layer, x, token_ids, expert_ids, weights)


def make_task(bank: ExpertWeights, job: CpuJob, num_threads: int) -> Task:
    """The native task where the kernel supports the layer's types and math, else `PythonTask`."""
    native = load_native()
    if native is not None and native.supports(bank):
        return ExpertTask(bank, job.x, job.expert_ids, job.weights, job.on_cpu, job.num_tokens, job.out,
                          num_threads=num_threads)
    return PythonTask(bank, job, num_threads)


@dataclass(frozen=True)
class CpuWork:
    """What the CPU tasks did so far (cumulative)."""

    calls: int = 0
    pairs: int = 0
    experts: int = 0
    bytes: int = 0
    busy_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Expert bytes read per second of CPU work."""
        return self.bytes / self.busy_seconds / 1e9 if self.busy_seconds else 0.0


class CpuTasks:
    def __init__(self, host: Mapping[int, ExpertWeights], rows: Mapping[int, int], max_tokens: int, top_k: int,
                 hidden: int, device: torch.device, num_threads: int, tier: RamTier | None = None,
                 rings: bool = True) -> None:
        """rows: the MoE row of each layer (the task index the device rings with). tier: the layers on disk.
        rings: the device rings for the tasks where it can (else each runs after a host sync: a split model, whose
        layers on several devices share the job)."""
        self.device, self.rows, self.num_threads = device, rows, num_threads
        self.job = CpuJob.allocate(max_tokens, top_k, hidden, pin=device.type == "cuda")
        self.tasks: dict[int, Task] = {
            layer: TierTask(layer, tier, bank, self.job, num_threads) if tier is not None and layer in tier.layouts
            else make_task(bank, self.job, num_threads) for layer, bank in host.items()}
        self.num_experts = {layer: bank.num_experts for layer, bank in host.items()}
        self.watcher: BellWatcher | None = None
        if rings and device.type == "cuda" and self.is_native:
            native = load_native()
            assert native is not None, "native tasks need the native library"
            native.start_pool(num_threads, spin_us=DECODE_SPIN_US)
            self.job = replace(self.job, bell=Bell.allocate(device))
            by_row = {rows[layer]: task for layer, task in self.tasks.items() if isinstance(task, ExpertTask)}
            table = [by_row.get(row) for row in range(max(rows.values(), default=-1) + 1)]
            self.watcher = BellWatcher(self.job.bell.words, table, DECODE_SPIN_US)  # type: ignore[union-attr]

    def run(self, layer: int) -> None:
        """Compute the layer's CPU pairs now (the job must be written)."""
        self.tasks[layer].run()

    @property
    def is_native(self) -> bool:
        """Every task is native code (no Python, no GIL)."""
        return all(isinstance(t, ExpertTask) for t in self.tasks.values())

    @property
    def rings(self) -> bool:
        """The device rings for every task (CUDA, native tasks): a step needs no host sync."""
        return self.watcher is not None

    def launch(self, layer: int, device: torch.device | None = None) -> None:
        """After the layer's job is written (on `device`, default the tasks' own): where the device rings, nothing
        (the watcher runs the task); else the task runs now, after a host sync (such a step is never captured)."""
        if self.watcher is None:
            on = device or self.device
            if on.type == "cuda":
                torch.cuda.current_stream(on).synchronize()
            self.run(layer)

    def device_seconds(self, layer: int, experts: int, repeats: int = 9) -> float:
        """CUDA, a ringing device: how long the device waits for the layer's task computing `experts` experts of
        one token (other experts each time, so they come from DRAM), from its ring to the answer; the median."""
        from ops.triton import hold
        from ops.triton.bell import ring_and_wait

        job, main, times = self.job, torch.cuda.current_stream(self.device), []
        assert job.bell is not None, "the device rings"
        pairs, n = job.expert_ids.shape[0], self.num_experts[layer]
        top_k = pairs // job.x.shape[0]
        for r in range(repeats):
            torch.cuda.synchronize(self.device)
            job.num_tokens[0], job.x[0] = 1, torch.randn(job.x.shape[1])
            job.expert_ids[:top_k] = torch.tensor([(r * top_k + i) % n if i < experts else -1 for i in range(top_k)])
            job.on_cpu[:top_k], job.weights[:top_k] = (job.expert_ids[:top_k] >= 0).to(torch.int32), 1.0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            hold(200_000, self.device)  # the device waits here while the host queues what is timed
            start.record(main)
            ring_and_wait(job.bell, self.rows[layer])
            end.record(main)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        job.num_tokens[0] = 0
        return sorted(times)[len(times) // 2]

    def close(self) -> None:
        if self.watcher is not None:
            torch.cuda.synchronize(self.device)  # NOTE: a step still running waits for its answers
            self.watcher.close()

    def work(self) -> CpuWork:
        totals = [t.counters for t in self.tasks.values()]
        return CpuWork(sum(c.calls for c in totals), sum(c.pairs for c in totals), sum(c.experts for c in totals),
                       sum(c.bytes for c in totals), sum(c.busy_ns for c in totals) / 1e9)
