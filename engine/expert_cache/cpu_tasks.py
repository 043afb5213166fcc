"""The CPU's share of each host layer's experts (cpu and hybrid miss modes).

The device writes the layer's CPU job (the MoE input rows, the routing, which pairs are the CPU's:
`ops.cache_step.assign_experts`) into pinned memory shared by the layers; the layer's task computes
those pairs from the experts in host RAM into the job's output, which the device adds to its own
experts' sum. On CUDA the task is a host node on a side stream (`ops.cuda_host`): the device computes
the hits while the CPU computes the misses, with no Python and no host sync in the step, so the step
stays one CUDA graph. On a CPU device the same task runs in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ops.bank import ExpertWeights
from ops.cache_step import CpuJob
from ops.cpu_experts import ExpertTask, TaskCounters, expert_ffn_cpu, load_native
from ops.cuda_host import launch_host_func

DECODE_SPIN_US = 2000  # idle pool workers spin this long before they sleep, where tasks are host nodes


class Task(Protocol):
    @property
    def function_address(self) -> int: ...  # a native `void fn(void *)`, or 0

    @property
    def address(self) -> int: ...  # its argument

    def run(self) -> None: ...

    @property
    def counters(self) -> TaskCounters: ...


class PythonTask:
    """A layer's CPU pairs through `expert_ffn_cpu` (expert types or an activation the native task lacks, or no C
    compiler): the same job and result, run from Python only (not a host node: such steps are not captured)."""

    function_address = 0
    address = 0

    def __init__(self, bank: ExpertWeights, job: CpuJob, num_threads: int) -> None:
        self.bank, self.job, self.num_threads = bank, job, num_threads
        self._counts = [0, 0, 0, 0, 0]  # calls, pairs, experts, bytes, busy ns

    def run(self) -> None:
        start = time.perf_counter_ns()
        job, top_k = self.job, self.job.expert_ids.shape[0] // self.job.x.shape[0]
        num_tokens = int(job.num_tokens[0])
        pairs = ((job.on_cpu[:num_tokens * top_k] != 0) & (job.expert_ids[:num_tokens * top_k] >= 0)).nonzero()[:, 0]
        experts = job.expert_ids[pairs].long()
        args = (job.x[:num_tokens], pairs // top_k, experts, job.weights[pairs], self.bank)
        job.out[:num_tokens] = expert_ffn_cpu(*args, num_threads=self.num_threads)
        distinct = int(experts.unique().numel())
        for i, n in enumerate((1, len(pairs), distinct, distinct * self.bank.expert_bytes,
                               time.perf_counter_ns() - start)):
            self._counts[i] += n

    @property
    def counters(self) -> TaskCounters:
        calls, pairs, experts, moved, busy = self._counts
        return TaskCounters(calls, pairs, experts, moved, busy, 0)


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
    def __init__(self, host: Mapping[int, ExpertWeights], max_tokens: int, top_k: int, hidden: int,
                 device: torch.device, num_threads: int) -> None:
        self.device = device
        self.job = CpuJob.allocate(max_tokens, top_k, hidden, pin=device.type == "cuda")
        self.tasks: dict[int, Task] = {layer: make_task(bank, self.job, num_threads) for layer, bank in host.items()}
        self.num_experts = {layer: bank.num_experts for layer, bank in host.items()}
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.side is not None and self.is_native:
            # NOTE: a decode step starts a layer's task every few hundred microseconds, after the device's
            # attention and router: workers that wait that long spinning start it at once, where workers
            # asleep in the kernel are woken one by one (the pool's default spin is 200 us)
            native = load_native()
            assert native is not None, "native tasks need the native library"
            native.start_pool(num_threads, spin_us=DECODE_SPIN_US)

    def run(self, layer: int) -> None:
        """Compute the layer's CPU pairs now (the job must be written)."""
        self.tasks[layer].run()

    @property
    def is_native(self) -> bool:
        """Every task is native code a CUDA graph can call as a host node."""
        return all(task.function_address for task in self.tasks.values())

    def launch(self, layer: int) -> Callable[[], None]:
        """Start the layer's task beside the device's work queued so far; returns the join that makes the
        current stream wait for the task (call it before reading the job's output)."""
        if self.side is None or not self.is_native:
            if self.side is not None:  # NOTE: a host sync: such a step is never captured
                torch.cuda.current_stream(self.device).synchronize()
            self.run(layer)
            return lambda: None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        task = self.tasks[layer]
        launch_host_func(self.side, task.function_address, task.address)
        side = self.side
        return lambda: main.wait_stream(side)

    def device_seconds(self, layer: int, experts: int, repeats: int = 9) -> float:
        """CUDA, native tasks: how long the device waits for the layer's task computing `experts` experts of one
        token (other experts each time, so they come from DRAM), from its launch to its join; the median."""
        from ops.triton import hold

        job, main, times = self.job, torch.cuda.current_stream(self.device), []
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
            self.launch(layer)()
            end.record(main)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        job.num_tokens[0] = 0
        return sorted(times)[len(times) // 2]

    def work(self) -> CpuWork:
        totals = [t.counters for t in self.tasks.values()]
        return CpuWork(sum(c.calls for c in totals), sum(c.pairs for c in totals), sum(c.experts for c in totals),
                       sum(c.bytes for c in totals), sum(c.busy_ns for c in totals) / 1e9)
