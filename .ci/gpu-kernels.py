"""Which GPU kernels a batch-1 decode step runs, how many and how long, and how much of the step's wall
time the GPU is busy: torch.profiler over N decode steps (the prompt step is run before the profile),
with CUDA graphs (the served path: kernels inside replayed graphs are reported one by one) and eager.
Usage: python3 .ci/gpu-kernels.py MODEL.gguf [steps] [config name substring]"""

import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.engine_setup import load_engine

CONFIGS = {
    "resident, graphs": (True, CacheConfig()),
    "resident, eager": (False, CacheConfig()),
    "cpu-moe, no cache, stream, graphs": (True, CacheConfig(cpu_moe=True, budget_mib=0, miss_mode="stream")),
}


def start(engine: LLMEngine, steps: int) -> None:
    """A request whose prompt step and 4 decode steps run now; `steps` decode steps remain."""
    engine.add_request(Request("r", tuple(range(1, 17)), SamplingParams(max_tokens=steps + 5, ignore_eos=True)))
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    engines: dict[bool, LLMEngine] = {}
    for name, (graphs, cache) in CONFIGS.items():
        if only not in name:
            continue
        if graphs not in engines:
            engines.clear()  # one model on the GPU at a time
            engines[graphs] = load_engine(EngineConfig(
                model=ModelConfig(path, max_context=256, cuda_graphs=graphs),
                scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)), routing="synthetic:qwen3")
        engine = engines[graphs]
        engine.reconfigure_cache(cache)
        start(engine, steps)  # warm-up: compile, capture
        while engine.has_unfinished():
            engine.step()
        start(engine, steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - began) / steps
        per_kernel: dict[str, list[float]] = defaultdict(list)
        intervals = []
        for event in prof.events():
            if event.device_type.name == "CUDA":
                per_kernel[event.name[:70]].append(event.device_time)
                intervals.append((event.time_range.start, event.time_range.end))
        total = sum(sum(v) for v in per_kernel.values()) / steps
        count = sum(len(v) for v in per_kernel.values()) / steps
        print(f"== {name}: {wall * 1e3:.2f} ms a step wall ({1 / wall:.1f} tok/s); {count:.0f} kernels, "
              f"{total / 1e3:.2f} ms of kernel time, GPU busy {busy_us(intervals) / steps / 1e3:.2f} ms a step")
        if graphs and engine.runner.graphs:  # the batch-1 graph alone: its kernels and the gaps between them
            graph = engine.runner.graphs[min(engine.runner.graphs)].graph
            began = time.perf_counter()
            for _ in range(steps):
                graph.replay()
                torch.cuda.synchronize()
            print(f"   batch-1 graph replayed alone: {(time.perf_counter() - began) / steps * 1e3:.2f} ms")
        for kernel, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:24]:
            print(f"{sum(times) / steps / 1e3:8.3f} ms {len(times) / steps:7.1f}x  {kernel}")


if __name__ == "__main__":
    main()
