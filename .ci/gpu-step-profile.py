"""Where a decode step's time goes, per cache configuration: the device timeline of the steps (kernels,
the gaps between them inside a step, the idle time between steps, which is the host's critical path),
the graph launch call in the decode loop (host time, and the device's time from it to the graph's end)
and the host's time per step split by function (cProfile).

Usage: python3 .ci/gpu-step-profile.py MODEL.gguf [--steps 16] [--warmup 400] [--batch 1]
           [--config NAME=SPEC]...
A SPEC is comma-separated `key=value` of: budget (a share of the host experts' bytes, 0..1), policy,
miss (cpu|stream|hybrid), ncmoe (--n-cpu-moe), and the flag `cpumoe`; `resident` alone means every
expert on the device. Default configs: resident; --cpu-moe at 25%, 50% and 100% budget (lru, stream); hybrid at
25% (decay) and 50% (lru), where the combine kernels' time is the device waiting for the CPU's answers.
Routing: ROUTING (default synthetic:qwen3). Runs on the CPU too (no device timeline there).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import time
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.engine_setup import load_engine

DEFAULT_CONFIGS = {
    "resident": "resident",
    "cpu-moe 25% lru stream": "cpumoe,budget=0.25,policy=lru,miss=stream",
    "cpu-moe 50% lru stream": "cpumoe,budget=0.5,policy=lru,miss=stream",
    "cpu-moe 100% lru stream": "cpumoe,budget=1,policy=lru,miss=stream",
    "cpu-moe 25% decay hybrid": "cpumoe,budget=0.25,policy=decay,miss=hybrid",
    "cpu-moe 50% lru hybrid": "cpumoe,budget=0.5,policy=lru,miss=hybrid",
}


def cache_config(engine: LLMEngine, spec: str) -> CacheConfig:
    fields = dict(part.partition("=")[::2] for part in spec.split(",") if part)
    if "resident" in fields:
        return CacheConfig()
    cpu_moe, n_cpu_moe = "cpumoe" in fields, int(fields.get("ncmoe", 0))
    layers = sorted(engine.store.layer_bytes())
    host = layers if cpu_moe else layers[:n_cpu_moe]
    host_bytes = sum(engine.store.layer_bytes()[i] for i in host)
    budget = math.ceil(float(fields.get("budget", 0)) * host_bytes / 2**20)
    return CacheConfig(policy=fields.get("policy", "lru"), miss_mode=fields.get("miss", "stream"),
                       budget_mib=budget, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe)


def start(engine: LLMEngine, batch: int, tokens: int) -> None:
    """`batch` requests that have their first token; `tokens` decode steps remain for each."""
    for i in range(batch):
        prompt = tuple(range(1 + i, 17 + i))
        engine.add_request(Request(f"p{time.monotonic_ns()}-{i}", prompt,
                                   SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)))
    while engine.scheduler.num_waiting or any(not s.output_ids for s in engine.scheduler.requests.values()):
        engine.step()


def decode(engine: LLMEngine, batch: int, tokens: int) -> float:
    """Seconds per decode step of `tokens` steps."""
    start(engine, batch, tokens)
    sync(engine)
    began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(engine)
    return (time.perf_counter() - began) / tokens


def sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@dataclass
class Kernel:
    name: str
    start: float  # us
    end: float


def kernels_of(prof: torch.profiler.profile) -> list[Kernel]:
    out = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    return sorted(out, key=lambda k: k.start)


def split_steps(kernels: list[Kernel], steps: int) -> list[list[Kernel]]:
    """Kernels grouped into steps at the `steps - 1` longest idle stretches (host work between steps)."""
    idle = sorted(range(1, len(kernels)), key=lambda i: kernels[i - 1].end - kernels[i].start)[:steps - 1]
    cuts = [0, *sorted(idle), len(kernels)]
    return [kernels[a:b] for a, b in zip(cuts, cuts[1:])]


def timeline_report(kernels: list[Kernel], steps: int) -> list[str]:
    if not kernels:
        return ["   (no device timeline: not a CUDA device)"]
    groups = split_steps(kernels, steps)
    lines = []
    busy = [sum(k.end - k.start for k in g) for g in groups]
    spans = [g[-1].end - g[0].start for g in groups]
    between = [b[0].start - a[-1].end for a, b in zip(groups, groups[1:])]
    n = len(groups)
    lines.append(f"   device: {sum(len(g) for g in groups) / n:.0f} kernels a step, {sum(busy) / n / 1e3:.3f} ms "
                 f"in kernels, step span {sum(spans) / n / 1e3:.3f} ms (gaps inside a step "
                 f"{(sum(spans) - sum(busy)) / n / 1e3:.3f} ms), idle between steps "
                 f"{sum(between) / max(len(between), 1) / 1e3:.3f} ms")
    middle = groups[n // 2]
    gaps = sorted(((b.start - a.end, a.name, b.name) for a, b in zip(middle, middle[1:])), reverse=True)[:6]
    for gap, before, after in gaps:
        lines.append(f"   gap {gap:7.1f} us  after {before[:48]}  before {after[:48]}")
    per_name: dict[str, list[float]] = {}
    for g in groups:
        for k in g:
            per_name.setdefault(k.name[:72], []).append(k.end - k.start)
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:14]:
        lines.append(f"   {sum(times) / n / 1e3:8.3f} ms {len(times) / n:6.1f}x  {name}")
    return lines


def host_report(profile: cProfile.Profile, steps: int) -> list[str]:
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(file)}:{line}({func})"
        rows.append((tottime, cumtime, calls, where))
    lines = []
    for tottime, cumtime, calls, where in sorted(rows, reverse=True)[:18]:
        lines.append(f"   host {tottime / steps * 1e6:8.1f} us self {cumtime / steps * 1e6:8.1f} us cum "
                     f"{calls / steps:7.1f}x  {where}")
    return lines


def profile_config(engine: LLMEngine, name: str, spec: str, args: argparse.Namespace) -> None:
    engine.reconfigure_cache(cache_config(engine, spec))
    decode(engine, args.batch, args.warmup)  # compile, capture, fill the cache
    seconds = decode(engine, args.batch, args.steps)
    snap_before, work_before = engine.cache.snapshot(), engine.cache.cpu_work()
    host = cProfile.Profile()
    start(engine, args.batch, args.steps)
    host.enable()
    began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(engine)
    host_seconds = (time.perf_counter() - began) / args.steps
    host.disable()
    snap = engine.cache.snapshot()
    hits, misses = snap.hits() - snap_before.hits(), snap.misses() - snap_before.misses()
    kernels: list[Kernel] = []
    if engine.device.type == "cuda":
        start(engine, args.batch, args.steps)
        sync(engine)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            while engine.has_unfinished():
                engine.step()
            sync(engine)
        kernels = kernels_of(prof)
    launch = graph_launch_us(engine)
    replays = replay_timeline(engine, args.batch, args.steps)
    hit = hits / (hits + misses) if hits + misses else float("nan")
    print(f"== {name} [{spec}]: {seconds * 1e3:.3f} ms a step ({args.batch / seconds:.1f} tok/s), hit {hit:.1%}; "
          f"under cProfile {host_seconds * 1e3:.3f} ms", flush=True)
    split, work = engine.cache.split, engine.cache.cpu_work()
    if split.is_hybrid or work.calls:
        experts, busy = work.experts - work_before.experts, work.busy_seconds - work_before.busy_seconds
        print(f"   split: share {split.share:.3f} lead {split.lead:.2f} (link {split.link_gbps:.1f} GB/s, CPU "
              f"{split.cpu_gbps:.1f} GB/s, fixed {split.fixed_seconds * 1e6:.1f} us); CPU {experts / args.steps:.1f} "
              f"experts a step, {busy / args.steps * 1e3:.3f} ms of work ({busy / max(experts, 1) * 1e6:.1f} us an "
              f"expert); link busy {split.link.busy:.2f}", flush=True)
    print("\n".join(timeline_report(kernels, args.steps) + [launch, replays] + host_report(host, args.steps)),
          flush=True)


def replay_timeline(engine: LLMEngine, batch: int, steps: int) -> str:
    """In the decode loop: the host's time in each graph launch call, and the device's from the call's start to the
    graph's end (CUDA events on the stream before and after the call; the device is idle before it), medians."""
    if engine.device.type != "cuda":
        return "   (no graph launches: not a CUDA device)"
    calls: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        began = time.perf_counter()
        replay(graph)
        calls.append(time.perf_counter() - began)
        after.record()
        events.append((before, after))

    start(engine, batch, steps)
    torch.cuda.CUDAGraph.replay = timed  # type: ignore[method-assign]
    try:
        while engine.has_unfinished():
            engine.step()
        sync(engine)
    finally:
        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    if not calls:
        return "   (no graph launches in the decode loop)"
    device = sorted(b.elapsed_time(a) for b, a in events)[len(events) // 2]
    return (f"   in the loop: launch call {sorted(calls)[len(calls) // 2] * 1e6:.0f} us (host), launch call to the "
            f"graph's end {device:.3f} ms (device), {len(calls)} launches")


def graph_launch_us(engine: LLMEngine) -> str:
    """Host time of one replay call of the smallest captured graph, and the graph alone on the device."""
    if not engine.runner.graphs:
        return "   (no captured graph)"
    graph = engine.runner.graphs[min(engine.runner.graphs)].graph
    calls, totals = [], []
    for _ in range(20):
        began = time.perf_counter()
        graph.replay()
        called = time.perf_counter()
        torch.cuda.synchronize()
        calls.append(called - began)
        totals.append(time.perf_counter() - began)
    return (f"   graph replay: {sorted(calls)[10] * 1e6:.0f} us in the launch call, "
            f"{sorted(totals)[10] * 1e3:.3f} ms to done (alone, synchronized)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--config", action="append", default=[], help="NAME=SPEC (see the module docstring)")
    args = parser.parse_args()
    configs = dict(c.split("=", 1) for c in args.config) if args.config else DEFAULT_CONFIGS
    routing = os.environ.get("ROUTING", "synthetic:qwen3")
    engine = load_engine(EngineConfig(
        model=ModelConfig(args.model, max_context=max(512, args.warmup + 64)),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch, 1), max_num_batched_tokens=max(64, args.batch * 16))),
        routing=routing)
    for name, spec in configs.items():
        profile_config(engine, name, spec, args)


if __name__ == "__main__":
    main()
