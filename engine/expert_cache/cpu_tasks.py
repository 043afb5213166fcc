"""The CPU's share of each host layer's experts (cpu and hybrid miss modes).

The device writes the layer's CPU job (the MoE input rows, the routing, which pairs are the CPU's:
`ops.cache_step.assign_experts`) into pinned memory shared by the layers; the layer's task computes
those pairs from the experts in host RAM into the job's output, which the device adds to its own
experts' sum. On CUDA the task is a host node on a side stream (`ops.cuda_host`): the device computes
the hits while the CPU computes the misses, with no Python and no host sync in the step, so the step
stays one CUDA graph. On a CPU device the same task runs in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ops.cache_step import CpuJob
from ops.cpu_experts import ExpertWeights
from ops.cpu_task import CpuTask, cpu_task
from ops.cuda_host import launch_host_func


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
        self.tasks: dict[int, CpuTask] = {layer: cpu_task(bank, self.job, num_threads)
                                             for layer, bank in host.items()}
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, layer: int) -> None:
        """Compute the layer's CPU pairs now (the job must be written)."""
        self.tasks[layer].run()

    @property
    def is_native(self) -> bool:
        """Every task is native code a CUDA graph can call as a host node."""
        return all(task.function for task in self.tasks.values())

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
        launch_host_func(self.side, task.function, task.argument)
        side = self.side
        return lambda: main.wait_stream(side)

    def work(self) -> CpuWork:
        totals = [t.counters() for t in self.tasks.values()]
        return CpuWork(*(sum(c[i] for c in totals) for i in range(4)), sum(c[4] for c in totals) / 1e9)
