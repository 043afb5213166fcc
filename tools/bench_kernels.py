"""Micro-benchmark of the Triton expert kernels on CUDA: `python -m tools.bench_kernels [--json PATH]`.

A Qwen3-30B-A3B layer (hidden 2048, ff 768, 128 experts, top-8) with random valid GGUF blocks:
(a) Q4_K in VRAM at batch 1, 8, 32 against a large device-to-device copy measured in the same run;
(b) the same experts in pinned host memory, read zero-copy, against a 16-byte-load read kernel of
pinned memory; (c) Q6_K and Q8_0 at batch 1; (d) the torch reference. Calls are timed as CUDA graph
replays (as the engine runs a decode step) and eagerly, median over replays after warm-up; each
graph runs ROUTINGS calls whose expert sets rotate through all experts, so no call finds its
experts in L2 (60 MB) from the previous one. GB/s counts the bytes of the distinct experts a call
reads. Prints a table; `--json` writes every number.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops import quants
from ops.bank import ExpertWeights
from ops.expert_ffn import expert_ffn_reference
from ops.triton import ExpertTables, LaunchConfig, grouped_expert_ffn, tables_from_bank
from ops.triton.combine import launch_combine
from ops.triton.down import launch_down
from ops.triton.experts import DEFAULT_CONFIG
from ops.triton.gate_up import launch_gate_up
from ops.triton.prepare import launch_prepare
from ops.triton.qdot import GROUP
from ops.triton.tables import QType

HIDDEN, FF, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
ROUTINGS = 16  # calls per graph, each on its own routing
REPLAYS = 15


@dataclass(frozen=True)
class Result:
    name: str
    batch: int
    us_graph: float  # median per call, CUDA graph replay
    us_eager: float  # median per call, launched from Python
    mb_per_call: float  # bytes of the distinct experts of a call (mean over the routings)
    gbps: float  # mb_per_call / us_graph
    pct_of_ceiling: float  # gbps / the ceiling that applies (HBM copy, or zero-copy read)


# --- ceilings ---------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_ms(lambda: dst.copy_(src)) / 1e6


@triton.jit
def _read_kernel(addr, out, num_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # program reads STEPS blocks of BLOCK int32 with 16-byte loads, xor-folds them (kept alive in out)
    base = tl.load(addr).to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK], tl.int32)
    for step in range(STEPS):
        offsets = (tl.program_id(0) * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
        ptrs = tl.max_contiguous(tl.multiple_of(base + offsets, 16), 16)
        acc ^= tl.load(ptrs, mask=offsets < num_words, other=0)
    tl.store(out + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


def read_gbps(buffer: torch.Tensor) -> float:
    """A plain read of `buffer` (VRAM, or pinned host memory read zero-copy) with 16-byte loads."""
    block, steps = 2048, 16
    num_words = buffer.numel() // 4
    grid = triton.cdiv(num_words, block * steps)
    addr = torch.tensor([buffer.data_ptr()], dtype=torch.int64, device="cuda")
    out = torch.empty(grid * block, dtype=torch.int32, device="cuda")
    ms = median_ms(lambda: _read_kernel[(grid,)](addr, out, num_words, BLOCK=block, STEPS=steps))
    return buffer.numel() / ms / 1e6


# --- layers -----------------------------------------------------------------------------------------


def random_bank(types: tuple[QType, QType, QType], generator: torch.Generator, pinned: bool) -> ExpertWeights:
    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        t = quants.random_blocks(qtype, NUM_EXPERTS * rows * blocks, generator).view(NUM_EXPERTS, rows, -1)
        return t.cpu().pin_memory() if pinned else t

    gate_type, up_type, down_type = types
    return ExpertWeights(projection(gate_type, FF, HIDDEN), projection(up_type, FF, HIDDEN),
                         projection(down_type, HIDDEN, FF), gate_type, up_type, down_type, HIDDEN, FF)


def routings(batch: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ROUTINGS routings (token_ids, expert_ids, weights) of `batch` tokens, top-8 distinct experts
    each. At batch 1 the calls take consecutive slices of one permutation of the experts, so no
    expert repeats within a graph; larger batches pick at random (64+ experts a call: > L2 anyway)."""
    order = torch.randperm(NUM_EXPERTS, generator=generator, device="cuda")
    out = []
    for call in range(ROUTINGS):
        if batch == 1:
            picks = order.roll(-TOP_K * call)[None, :TOP_K]
        else:
            picks = torch.rand(batch, NUM_EXPERTS, generator=generator, device="cuda").topk(TOP_K, dim=1).indices
        weights = torch.rand(batch, TOP_K, generator=generator, device="cuda")
        token_ids = torch.arange(batch, device="cuda").repeat_interleave(TOP_K)
        out.append((token_ids, picks.reshape(-1), (weights / weights.sum(1, keepdim=True)).reshape(-1)))
    return out


def time_calls(calls: list[Callable[[], object]]) -> tuple[float, float]:
    """(graph us, eager us) per call, medians."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph_ms = median_ms(graph.replay, REPLAYS)
    eager_ms = median_ms(lambda: [call() for call in calls], 5)
    return 1e3 * graph_ms / len(calls), 1e3 * eager_ms / len(calls)


def _layer_call(x: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tables: ExpertTables,
                config: LaunchConfig) -> Callable[[], object]:
    token_ids, expert_ids, weights = route
    return lambda: grouped_expert_ffn(x, token_ids, expert_ids, weights, tables, config=config)


def measure(name: str, bank: ExpertWeights, batch: int, ceiling_gbps: float, generator: torch.Generator,
            config: LaunchConfig = DEFAULT_CONFIG) -> Result:
    tables = tables_from_bank(bank, torch.device("cuda"))
    xs = [torch.randn(batch, HIDDEN, generator=generator, device="cuda").bfloat16() for _ in range(ROUTINGS)]
    route = routings(batch, generator)
    us_graph, us_eager = time_calls([_layer_call(x, r, tables, config) for x, r in zip(xs, route)])
    mb = statistics.mean(r[1].unique().numel() for r in route) * tables.expert_bytes / 1e6
    gbps = mb / us_graph * 1e3
    return Result(name, batch, us_graph, us_eager, mb, gbps, 100 * gbps / ceiling_gbps)


def stages(bank: ExpertWeights, generator: torch.Generator) -> dict[str, float]:
    """us per call of each launch of a batch-1 call (CUDA graphs of ROUTINGS calls)."""
    tables = tables_from_bank(bank, torch.device("cuda"))
    route = routings(1, generator)
    x = torch.randn(1, HIDDEN, generator=generator, device="cuda").bfloat16()
    x_gate, x_sums = launch_prepare(x, bank.gate_type)
    h = torch.empty(TOP_K, FF, device="cuda")
    h_sums = torch.empty(TOP_K, FF // GROUP, device="cuda")
    y = torch.empty(TOP_K, HIDDEN, device="cuda")
    out = torch.empty(1, HIDDEN, device="cuda")
    Route = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    launches: dict[str, Callable[[Route], object]] = {
        "prepare": lambda r: launch_prepare(x, bank.gate_type),
        "gate_up": lambda r: launch_gate_up(x_gate, x_gate, x_sums, r[0], r[1], tables, h, h_sums),
        "down": lambda r: launch_down(h, h_sums, r[1], r[2], tables, y),
        "combine": lambda r: launch_combine(y, r[0], out),
    }
    return {name: time_calls([functools.partial(launch, r) for r in route])[0] for name, launch in launches.items()}


def torch_reference(bank: ExpertWeights, batch: int, generator: torch.Generator) -> Result:
    tables: ExpertTables = tables_from_bank(bank, torch.device("cuda"))
    x = torch.randn(batch, HIDDEN, generator=generator, device="cuda").bfloat16()
    token_ids, expert_ids, weights = routings(batch, generator)[0]
    ms = median_ms(lambda: expert_ffn_reference(x, token_ids, expert_ids, weights, bank), 5)  # type: ignore[arg-type]
    mb = expert_ids.unique().numel() * tables.expert_bytes / 1e6
    return Result("torch reference, Q4_K VRAM", batch, float("nan"), 1e3 * ms, mb, mb / ms, float("nan"))


# --- the run ----------------------------------------------------------------------------------------


def sweep(bank: ExpertWeights, hbm: float, generator: torch.Generator) -> list[dict[str, object]]:
    """Block shapes for Q4_K in VRAM: rows per program at batch 1, pairs per pass at batch 8 and 32."""
    rows = [(1, LaunchConfig(gate_up_rows=g, down_rows=d)) for g in (16, 32) for d in (16, 32, 64)]
    tokens = [(batch, LaunchConfig(block_tokens=t)) for batch in (8, 32) for t in (1, 2, 4)]
    return [dict(asdict(config), **asdict(measure("sweep", bank, batch, hbm, generator, config)))
            for batch, config in rows + tokens]


def run() -> dict[str, object]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    hbm, hbm_read = copy_gbps(), read_gbps(torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_())
    zero_copy = read_gbps(torch.empty(1 << 30, dtype=torch.uint8).random_().pin_memory())
    q4k = (QType.Q4_K,) * 3
    vram, host = random_bank(q4k, generator, pinned=False), random_bank(q4k, generator, pinned=True)
    results = [measure("Q4_K VRAM", vram, batch, hbm, generator) for batch in (1, 8, 32)]
    results += [measure("Q4_K pinned host (zero-copy)", host, batch, zero_copy, generator) for batch in (1, 8, 32)]
    for qtype in (QType.Q6_K, QType.Q8_0):
        bank = random_bank((qtype,) * 3, generator, pinned=False)
        results.append(measure(f"{qtype.name} VRAM", bank, 1, hbm, generator))
        del bank
    results += [torch_reference(vram, batch, generator) for batch in (1, 8)]
    return {
        "stages_us_q4k_vram_batch1": stages(vram, generator),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "ceilings_gbps": {"hbm_copy_read_plus_write": hbm, "hbm_read_kernel": hbm_read,
                          "pinned_zero_copy_read": zero_copy},
        "results": [asdict(r) for r in results],
        "sweep": sweep(vram, hbm, generator),
    }


def print_table(report: dict[str, object]) -> None:
    ceilings = report["ceilings_gbps"]
    assert isinstance(ceilings, dict)
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}")
    print("ceilings (GB/s): " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))
    stage_us = report["stages_us_q4k_vram_batch1"]
    assert isinstance(stage_us, dict)
    print("Q4_K VRAM batch 1, us per launch (graph): " + ", ".join(f"{k} {v:.1f}" for k, v in stage_us.items()))
    print(f"{'case':34} {'batch':>5} {'us graph':>9} {'us eager':>9} {'MB/call':>8} {'GB/s':>7} {'% ceil':>7}")
    for rows in (report["results"], report["sweep"]):
        assert isinstance(rows, list)
        for r in rows:
            label = r["name"] if r["name"] != "sweep" else (
                f"sweep rows {r['gate_up_rows']}/{r['down_rows']} bt {r['block_tokens']}")
            print(f"{label:34} {r['batch']:>5} {r['us_graph']:>9.1f} {r['us_eager']:>9.1f} {r['mb_per_call']:>8.1f} "
                  f"{r['gbps']:>7.0f} {r['pct_of_ceiling']:>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the full report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools.bench_kernels needs a CUDA device")
    report = run()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print_table(report)


if __name__ == "__main__":
    main()
