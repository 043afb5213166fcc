"""Where a prompt's time goes (issue 16's pp512): one `prompt_len`-token prefill profiled after a warm one, per
configuration: wall time and tokens/s, the device's kernels by name (time, count) and how busy it was, then the
host's time by function (cProfile, a third prefill) where the device waits for it.
Usage: [ROUTING=model] python3 .ci/gpu-prefill-profile.py MODEL.gguf [prompt_len] [config name substring]
(ROUTING: bench's routing, default synthetic:qwen3; `model`, the model's router, lets a resident prompt's first chunk
replay a CUDA graph, `engine/runner.py`)
(on a machine without CUDA it profiles the CPU's operators: a smoke run)"""

import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.bench.runner import apply
from service.bench.sweep import SweepPoint
from service.engine_setup import load_engine

CONFIGS = {  # bench's configurations (`--n-cpu-moe 0` / `--cpu-moe`, `--budget-frac`)
    "resident": SweepPoint("decay", "stream", 0),
    "cpu-moe, no cache": SweepPoint("decay", "stream", 10_000, budget_frac=0.0),
    "cpu-moe, 50% cache": SweepPoint("decay", "stream", 10_000, budget_frac=0.5),
}
CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def prefill(engine: LLMEngine, prompt_len: int, tag: str) -> float:
    """Seconds of one request's prompt step (it generates one token)."""
    prompt = tuple(1 + (i * 7919) % 1000 for i in range(prompt_len))
    engine.add_request(Request(tag, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    sync()
    began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return time.perf_counter() - began


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    path = sys.argv[1]
    prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    engine = load_engine(EngineConfig(
        model=ModelConfig(path, max_context=prompt_len + 64),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=prompt_len)),
        routing=os.environ.get("ROUTING", "synthetic:qwen3"))
    for name, cache in CONFIGS.items():
        if only not in name:
            continue
        skipped = apply(engine, cache)
        if skipped:
            print(f"== {name}: skipped ({skipped})")
            continue
        prefill(engine, prompt_len, f"{name}-warm")  # compiles, stages, fills what it fills
        activity = ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            wall = prefill(engine, prompt_len, f"{name}-profiled")
        per_op: dict[str, list[float]] = defaultdict(list)
        intervals = []
        for event in prof.events():
            if event.device_type.name == ("CUDA" if CUDA else "CPU"):
                took = event.device_time if CUDA else event.cpu_time
                per_op[event.name[:70]].append(took)
                intervals.append((event.time_range.start, event.time_range.end))
        total = sum(sum(v) for v in per_op.values())
        print(f"== {name}: {wall * 1e3:.1f} ms for {prompt_len} tokens ({prompt_len / wall:.0f} tok/s); "
              f"{sum(len(v) for v in per_op.values())} {'kernels' if CUDA else 'operators'}, {total / 1e3:.1f} ms in "
              f"them, busy {busy_us(intervals) / 1e3:.1f} ms")
        for op, times in sorted(per_op.items(), key=lambda kv: -sum(kv[1]))[:20]:
            print(f"{sum(times) / 1e3:9.2f} ms {len(times):6d}x  {op}")
        host = cProfile.Profile()
        host.enable()
        wall = prefill(engine, prompt_len, f"{name}-host")
        host.disable()
        out = io.StringIO()
        pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(14)
        print(f"   host (cProfile, {wall * 1e3:.1f} ms with it):")
        print("\n".join("   " + line for line in out.getvalue().splitlines()[6:22] if line.strip()))


if __name__ == "__main__":
    main()
