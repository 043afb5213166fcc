"""Which GPU kernels a batch-1 decode step runs, how many and how long: torch.profiler over N eager
steps (CUDA graphs off, so each launch is visible), every expert resident or none cached.
Usage: python3 .ci/gpu-kernels.py MODEL.gguf [steps]"""

import sys
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams

CONFIGS = {"resident": CacheConfig(), "cpu-moe, no cache, stream": CacheConfig(cpu_moe=True, budget_mib=0,
                                                                                miss_mode="stream")}


def decode(engine: LLMEngine, steps: int) -> None:
    engine.add_request(Request("r", tuple(range(1, 17)), SamplingParams(max_tokens=steps + 1, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    engine = LLMEngine(EngineConfig(model=ModelConfig(path, max_context=256, cuda_graphs=False),
                                    routing="synthetic:qwen3",
                                    scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)))
    for name, cache in CONFIGS.items():
        engine.reconfigure_cache(cache)
        decode(engine, 4)  # warm-up: compile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode(engine, steps)
        per_kernel: dict[str, list[float]] = defaultdict(list)
        for event in prof.events():
            if event.device_type.name == "CUDA":
                per_kernel[event.name[:70]].append(event.device_time)
        total = sum(sum(v) for v in per_kernel.values()) / (steps + 1)
        count = sum(len(v) for v in per_kernel.values()) / (steps + 1)
        print(f"== {name}: {count:.0f} kernels, {total / 1e3:.2f} ms of GPU time per step (prompt step included)")
        for kernel, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:22]:
            print(f"{sum(times) / (steps + 1) / 1e3:8.3f} ms {len(times) / (steps + 1):7.1f}x  {kernel}")


if __name__ == "__main__":
    main()
