"""Where a decode step's time goes, per cache configuration: the device timeline of the steps (kernels,
the gaps between them inside a step, the idle time between steps, which is the host's critical path),
the graph launch call (alone, behind device work, in the decode loop with the device's time from it to the graph's
end), the captured graph's nodes by type (`--census`), the threads that ran in the loop, the host's phases of a
step (what runs while the device computes, what the device waits for) and the host's time per step split by
function (cProfile, whose own cost inflates short calls: `--launch-only` leaves it and the device timeline out).

Usage: python3 .ci/gpu-step-profile.py MODEL.gguf [--steps 16] [--warmup 400] [--batch 1] [--census]
           [--launch-only] [--config NAME=SPEC]...
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


def timeline_report(kernels: list[Kernel], steps: int, top: int = 14, sequence: int = 0) -> list[str]:
    """The steps' kernels: counts and time, the largest gaps of the middle step, its `top` kernel names by time and
    its first `sequence` kernels in order (a layer's ops one by one)."""
    if not kernels:
        return ["   (no device timeline: --launch-only, or not a CUDA device)"]
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
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"   {sum(times) / n / 1e3:8.3f} ms {len(times) / n:6.1f}x  {name}")
    for a, b in zip(middle[:sequence], middle[1:sequence + 1]):
        lines.append(f"   seq {(a.end - a.start):7.1f} us  then {b.start - a.end:5.1f} us idle  {a.name[:90]}")
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
    host_seconds = math.nan
    if not args.launch_only:
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
    if engine.device.type == "cuda" and not args.launch_only:
        start(engine, args.batch, args.steps)
        sync(engine)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            while engine.has_unfinished():
                engine.step()
            sync(engine)
        kernels = kernels_of(prof)
    launch = "\n".join([graph_launch_us(engine), launch_on_busy_device(engine), graph_census(engine),
                         busy_threads(engine, args.batch, args.steps), host_phases(engine, args.batch, args.steps)])
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
    host_lines = [] if args.launch_only else host_report(host, args.steps)
    print("\n".join(timeline_report(kernels, args.steps, args.top, args.sequence) + [launch, replays] + host_lines),
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


NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait",
              7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "alloc", 11: "free",
              12: "memory op", 13: "conditional"}


def graph_census(engine: LLMEngine) -> str:
    """The smallest captured graph's nodes by type and its edges (CUDA driver API; graphs kept, see `--census`):
    a graph of kernels alone in one chain launches on the driver's fast path."""
    import ctypes
    from collections import Counter

    graph = engine.runner.graphs[min(engine.runner.graphs)].graph if engine.runner.graphs else None
    if graph is None or not getattr(graph, "_kept", False):
        return "   (no kept graph: run with --census)"
    cuda = ctypes.CDLL("libcuda.so.1")
    raw, count = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
    cuda.cuGraphGetNodes(raw, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    cuda.cuGraphGetNodes(raw, nodes, ctypes.byref(count))
    kinds: Counter[str] = Counter()
    for node in nodes:
        kind = ctypes.c_int()
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        kinds[NODE_TYPES.get(kind.value, str(kind.value))] += 1
    edges = ctypes.c_size_t(0)
    cuda.cuGraphGetEdges(raw, None, None, ctypes.byref(edges))
    return f"   graph nodes: {dict(kinds)}, {edges.value} edges ({count.value - 1} in one chain)"


def host_phases(engine: LLMEngine, batch: int, steps: int) -> str:
    """The host's time in each phase of a decode step (medians of the loop's steps, wall time): what runs while
    the device computes (after the launch: uploads, the last record's processing, the router's work ahead) and
    what the device waits for (the read's wait is the device's time left, its record's `step_done` inside it; with
    decode ahead the next step is launched before the last is read, and none of it is on the device's path)."""
    import engine.llm_engine as llm

    phases = {"schedule": (engine.scheduler, "schedule"), "schedule ahead": (engine.scheduler, "schedule_ahead"),
              "router begin": (engine.model.router, "begin_step"),
              "prepare_step": (engine.cache, "prepare_step"), "launch": (engine.runner, "forward"),
              "uploads": (engine.cache, "launched"), "process": (engine.cache, "process"),
              "router ahead": (engine.model.router, "while_running"), "sample": (llm, "sample_on_device"),
              "read (waits)": (engine, "_read"), "update": (engine, "update")}
    spent: dict[str, float] = {}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in phases.items()}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            began = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - began
        return run

    start(engine, batch, steps)
    sync(engine)
    per_step: list[dict[str, float]] = []
    for name, (owner, attr) in phases.items():
        setattr(owner, attr, timed(name, originals[name]))
    try:
        while engine.has_unfinished():
            spent.clear()
            began = time.perf_counter()
            engine.step()
            per_step.append({**spent, "step": time.perf_counter() - began})
    finally:
        for name, (owner, attr) in phases.items():
            setattr(owner, attr, originals[name])
    sync(engine)
    middle = lambda key: sorted(s.get(key, 0.0) for s in per_step)[len(per_step) // 2] * 1e6  # noqa: E731
    return "   host phases (us, medians): " + ", ".join(f"{name} {middle(name):.0f}" for name in [*phases, "step"])


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by name and id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{task}/comm").read().strip()
            fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{name}/{task}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(engine: LLMEngine, batch: int, steps: int) -> str:
    """The threads that ran in the decode loop, with their share of its wall time (a spinning thread shows ~100%)."""
    start(engine, batch, steps)
    sync(engine)
    before, began = thread_cpu(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(engine)
    wall, after = time.perf_counter() - began, thread_cpu()
    rows = sorted(((after[t] - before.get(t, 0.0)) / wall, t) for t in after)
    shown = ", ".join(f"{t} {share:.0%}" for share, t in reversed(rows) if share >= 0.03)
    return f"   threads in the loop ({len(after)} in all): {shown or 'none above 3%'}"


def launch_on_busy_device(engine: LLMEngine) -> str:
    """Host time of a replay call issued while the device still runs earlier work (a 2 ms spin), against idle."""
    if not engine.runner.graphs:
        return "   (no captured graph)"
    graph = engine.runner.graphs[min(engine.runner.graphs)].graph
    busy = []
    for _ in range(10):
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000)  # about 2 ms at H200 clocks
        began = time.perf_counter()
        graph.replay()
        busy.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return f"   graph replay behind 2 ms of device work: {sorted(busy)[5] * 1e6:.0f} us in the launch call"


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
    parser.add_argument("--census", action="store_true",
                        help="keep each captured graph's cudaGraph_t to count its nodes by type")
    parser.add_argument("--launch-only", action="store_true", help="no cProfile and no device timeline")
    parser.add_argument("--top", type=int, default=14, help="kernel names listed by their time a step")
    parser.add_argument("--sequence", type=int, default=0, help="the middle step's first N kernels listed in order")
    args = parser.parse_args()
    if args.census:
        class KeptGraph(torch.cuda.CUDAGraph):  # instantiated at its first replay, its graph kept
            _kept = True

            def __new__(cls, keep_graph: bool = True) -> KeptGraph:
                return super().__new__(cls, True)

            def __init__(self, keep_graph: bool = True) -> None:
                super().__init__(True)

        torch.cuda.CUDAGraph = KeptGraph  # type: ignore[misc]
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
