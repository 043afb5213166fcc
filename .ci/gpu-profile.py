"""Where a decode step's time goes: cProfile of N batch-1 decode steps for a few placements.
Usage: python3 .ci/gpu-profile.py MODEL.gguf [steps]"""

import cProfile
import io
import pstats
import sys
import time

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


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24
    base = EngineConfig(model=ModelConfig(path, max_context=256), routing="synthetic:qwen3",
                        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64))
    engine = LLMEngine(base)
    for name, cache in CONFIGS.items():
        engine.reconfigure_cache(cache)
        decode(engine, steps)  # warm-up: compile, capture
        profile = cProfile.Profile()
        profile.enable()
        seconds = decode(engine, steps)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(f"== {name}: {seconds * 1e3:.2f} ms per token ({1 / seconds:.1f} tok/s)")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-1600:])


if __name__ == "__main__":
    main()
