"""Where a prompt's time goes (issue 16's pp512): one `prompt_len`-token prefill profiled after a warm one, per
configuration: wall time and tokens/s, the device's kernels by name (time, count) and how busy it was, then the
host's time by function (cProfile, a third prefill) where the device waits for it. The host -> device copies' timeline:
how long the link was busy between the prompt's first and last copy, and its longest idle stretches with the kernels
that ran meanwhile (a staged prompt's floor is its copies back to back).
Usage: [ROUTING=model] [PROFILE=FILE] python3 .ci/gpu-prefill-profile.py MODEL.gguf [prompt_len] [config name substring]
(PROFILE: bench's `--cache-profile`, so that a cache starts full as bench's prompt rows do)
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

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.bench.runner import apply
from service.bench.sweep import SweepPoint
from service.engine_setup import load_engine

CONFIGS = {  # bench's prompt rows' configurations (`--n-cpu-moe 0` / `--cpu-moe`, `--budget-frac`, `--policy lru`)
    "resident": SweepPoint("lru", "stream", 0),
    "cpu-moe, no cache": SweepPoint("lru", "stream", 10_000, budget_frac=0.0),
    "cpu-moe, 50% cache": SweepPoint("lru", "stream", 10_000, budget_frac=0.5),
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


def link_timeline(events: list[tuple[str, float, float]]) -> None:
    """(name, start us, end us) of the device's events: the host -> device copies' busy time over their span, and
    their five longest idle stretches with the kernels that ran in each."""
    copies = sorted((a, b) for name, a, b in events if "HtoD" in name)
    if not copies:
        return
    span = copies[-1][1] - copies[0][0]
    print(f"   link: {len(copies)} copies, busy {busy_us(copies) / 1e3:.1f} ms of the {span / 1e3:.1f} ms from the "
          f"first to the last (the prompt's first event at +0, the first copy at "
          f"+{(copies[0][0] - min(a for _, a, _ in events)) / 1e3:.1f} ms)")
    idle, end = [], copies[0][1]
    for a, b in copies[1:]:
        if a > end:
            idle.append((a - end, end, a))
        end = max(end, b)
    first = min(a for _, a, _ in events)
    for gap, a, b in sorted(idle, reverse=True)[:5]:
        during: dict[str, float] = defaultdict(float)
        for name, x, y in events:
            if "Memcpy" not in name and x < b and y > a:
                during[name[:40]] += min(y, b) - max(x, a)
        top = ", ".join(f"{n} {t / 1e3:.2f}" for n, t in sorted(during.items(), key=lambda kv: -kv[1])[:3])
        print(f"   link idle {gap / 1e3:6.2f} ms at +{(a - first) / 1e3:.1f} ms; kernels then (ms): {top or '-'}")
    kernels = sorted((a, b) for name, a, b in events if "Memcpy" not in name)
    gaps, end = [], kernels[0][1]
    for a, b in kernels[1:]:
        if a > end:
            gaps.append((a - end, end, a))
        end = max(end, b)
    last_copy, last_kernel = copies[-1][1], kernels[-1][1]
    print(f"   kernels idle {sum(g for g, _, _ in gaps) / 1e3:.1f} ms of the prompt's "
          f"{(last_kernel - first) / 1e3:.1f} ms; its last kernel ends {(last_kernel - last_copy) / 1e3:.1f} ms after "
          f"the last copy")
    for gap, a, b in sorted(gaps, reverse=True)[:5]:
        busy = busy_us([(max(x, a), min(y, b)) for x, y in copies if x < b and y > a])
        print(f"   kernels idle {gap / 1e3:6.2f} ms at +{(a - first) / 1e3:.1f} ms; the link busy {busy / 1e3:.2f} ms "
              f"of it")


def main() -> None:
    path = sys.argv[1]
    prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    engine = load_engine(EngineConfig(
        model=ModelConfig(path, max_context=prompt_len + 64), cache=CacheConfig(profile_in=os.environ.get("PROFILE")),
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
        intervals, timeline = [], []
        for event in prof.events():
            if event.device_type.name == ("CUDA" if CUDA else "CPU"):
                took = event.device_time if CUDA else event.cpu_time
                per_op[event.name[:70]].append(took)
                intervals.append((event.time_range.start, event.time_range.end))
                timeline.append((event.name, event.time_range.start, event.time_range.end))
        total = sum(sum(v) for v in per_op.values())
        print(f"== {name}: {wall * 1e3:.1f} ms for {prompt_len} tokens ({prompt_len / wall:.0f} tok/s); "
              f"{sum(len(v) for v in per_op.values())} {'kernels' if CUDA else 'operators'}, {total / 1e3:.1f} ms in "
              f"them, busy {busy_us(intervals) / 1e3:.1f} ms")
        for op, times in sorted(per_op.items(), key=lambda kv: -sum(kv[1]))[:20]:
            print(f"{sum(times) / 1e3:9.2f} ms {len(times):6d}x  {op}")
        link_timeline(timeline)
        stager = getattr(engine.cache.dispatcher, "stager", None)
        if stager is not None:
            print(f"   staging buffers: {[len(pool) for pool in stager.buffers.values()]} (at most "
                  f"{dict(stager.most) or 'as many as MAX_BUFFERS'})")
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
