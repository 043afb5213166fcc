"""Where a decode step's time goes: cProfile of N batch-1 decode steps for a few placements, and wall
time per MoE layer call split into its parts (the host's share of the routing, the CPU kernel in its
thread, the wait for it).
Usage: python3 .ci/gpu-profile.py MODEL.gguf [steps] [config name substring]"""

import cProfile
import functools
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import engine.expert_cache.executor as executor
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams

CONFIGS = {
    "resident": CacheConfig(),
    "cpu-moe, no cache, misses on cpu": CacheConfig(cpu_moe=True, budget_mib=0, miss_mode="cpu"),
    "cpu-moe, no cache, misses on stream": CacheConfig(cpu_moe=True, budget_mib=0, miss_mode="stream"),
}


def decode(engine: LLMEngine, steps: int) -> float:
    engine.add_request(Request("r", tuple(range(1, 17)), SamplingParams(max_tokens=steps + 1, ignore_eos=True)))
    engine.step()  # the prompt
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) / steps


SPENT: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn):  # noqa: ANN001, ANN201
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name].append(time.perf_counter() - start)
    return wrapper


executor.ExpertCache.__call__ = timed("moe layer call", executor.ExpertCache.__call__)
executor.ExpertCache._split = timed("split (host routing, submit)", executor.ExpertCache._split)
executor.expert_ffn_cpu = timed("cpu kernel (its thread)", executor.expert_ffn_cpu)
executor._CpuPart.result = timed("wait for the cpu part", executor._CpuPart.result)


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    routing = os.environ.get("ROUTING", "synthetic:qwen3")  # "model": the model's own routers
    base = EngineConfig(model=ModelConfig(path, max_context=256), routing=routing,
                        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64))
    engine = LLMEngine(base)
    for name, cache in CONFIGS.items():
        if only not in name:
            continue
        engine.reconfigure_cache(cache)
        decode(engine, steps)  # warm-up: compile, capture
        plain = decode(engine, steps)
        SPENT.clear()
        profile = cProfile.Profile()
        profile.enable()
        seconds = decode(engine, steps)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"== {name}: {plain * 1e3:.2f} ms per token ({1 / plain:.1f} tok/s); "
              f"{seconds * 1e3:.2f} ms under the profiler")
        for part, times in SPENT.items():
            print(f"   {part}: {sum(times) / len(times) * 1e6:.0f} us x {len(times) / steps:.0f} per token")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-3200:])


if __name__ == "__main__":
    main()
