"""The decode kernels of the grouped expert FFN (`ops.triton.gate_up`, `ops.triton.down`) over a small grid of block
shapes, on one layer of each of six expert shapes: Qwen3-30B-A3B in Q4_K_M's mix (Q6_K down) and in Q4_K, Gemma 4
26B-A4B in Q4_0 with GELU (`engine.arch.gemma4`'s math), DeepSeek-V2-Lite in Q8_0, gpt-oss-20b in MXFP4 with clamped
SwiGLU and gate/up/down biases, in GGUF's blocks and planar (`ops.bank.to_planar`, as a resident layer). At 1 and 8
tokens x top-k (each token's experts distinct and random): the microseconds of gate/up, of down and of the whole
`grouped_expert_ffn`, and the GB/s of the expert bytes read.

A time is the median of `replays` replays of a CUDA graph of 20 launches (the engine replays its steps), divided
by 20. Each launch routes to other experts than the launch before it where there are enough, so that it does not
find its weights in L2 (8 experts of Qwen3 fit in the H200's 50 MB). Weights are random blocks of the real formats,
on the device. Order: every default first (all shapes, both batches), then 8 and 16 blocks of 32 a step for the
32-block formats (`ops.triton.qdot.step_blocks`), then gate_up_rows x num_warps and down_rows x num_warps (default
warps, 2x, 4) at 1 token and then at 8, then the whole FFN at the fastest rows.
Starts nothing after `budget_s` seconds (most of a config's cost is compiling; an H200 run ends within a minute)
and lists what it skipped. A config that fails is one line saying why. In the tables `*` marks the default
(`ops.triton.experts.DEFAULT_CONFIG`, the launchers' own warps), `<` the fastest of its kernel.
With `ncu`, each shape's default gate/up and down launch at 1 token (and Qwen3-30B-A3B's at 8) runs once between
cudaProfilerStart and Stop (after warm-up launches outside), for Nsight Compute to read their counters (under
`ncu --profile-from-start off`).
Usage: [ONLY=TEXT] PYTHONPATH=/tmp/site:$PWD python3 .ci/gpu-expert-sweep.py [budget_s=50] [replays=5]  (needs CUDA;
       ONLY: the shapes whose name holds TEXT)
       PYTHONPATH=/tmp/site:$PWD ncu --profile-from-start off --section ... python3 .ci/gpu-expert-sweep.py ncu"""

import time

START = time.monotonic()

import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from itertools import zip_longest  # noqa: E402

import torch  # noqa: E402

from engine.arch.gemma4 import GELU  # noqa: E402
from engine.arch.gptoss import SWIGLU_ALPHA, SWIGLU_LIMIT  # noqa: E402
from ops import quants  # noqa: E402
from ops.bank import ExpertWeights, to_planar  # noqa: E402
from ops.expert_math import PLAIN, ExpertMath  # noqa: E402
from ops.quants import QType  # noqa: E402
from ops.triton import ExpertTables, LaunchConfig, grouped_expert_ffn, tables_from_bank  # noqa: E402
from ops.triton.down import launch_down  # noqa: E402
from ops.triton.experts import DEFAULT_CONFIG  # noqa: E402
from ops.triton.gate_up import default_block_tokens, launch_gate_up, warps_for  # noqa: E402
from ops.triton.prepare import launch_prepare  # noqa: E402
from ops.triton.qdot import GROUP, reads_int8  # noqa: E402

DEVICE = torch.device("cuda")
LAUNCHES = 20  # per graph
TOKENS = (1, 8)
GATE_UP_ROWS = (16, 32, 64)  # at least qdot.GROUP rows
DOWN_ROWS = (16, 32, 64, 128)
Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token_ids, expert_ids, weights `[pairs]`


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    ff: int
    num_experts: int
    top_k: int
    types: tuple[QType, QType, QType]  # gate, up, down
    math: ExpertMath = PLAIN
    has_biases: bool = False  # random gate/up/down biases added to `math`
    planar: bool = False  # MXFP4 as a resident bank holds it (`ops.bank.to_planar`)

    def __str__(self) -> str:
        types = "/".join(t.name for t in self.types)
        return (f"{self.name}: hidden {self.hidden}, ff {self.ff}, {self.num_experts} experts, top {self.top_k}, "
                f"{types}, {self.math.activation}{' + biases' if self.has_biases else ''}")


SWIGLU_OAI = ExpertMath("swiglu_oai", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)
SHAPES = (
    Shape("qwen3-30b-a3b Q4_K_M", 2048, 768, 128, 8, (QType.Q4_K, QType.Q4_K, QType.Q6_K)),
    Shape("qwen3-30b-a3b Q4_K", 2048, 768, 128, 8, (QType.Q4_K, QType.Q4_K, QType.Q4_K)),
    Shape("gemma4-26b-a4b Q4_0", 2816, 704, 128, 8, (QType.Q4_0, QType.Q4_0, QType.Q4_0), GELU),
    Shape("deepseek-v2-lite Q8_0", 2048, 1408, 64, 6, (QType.Q8_0, QType.Q8_0, QType.Q8_0)),
    Shape("gpt-oss-20b MXFP4", 2880, 2880, 32, 4, (QType.MXFP4, QType.MXFP4, QType.MXFP4), SWIGLU_OAI, True),
    Shape("gpt-oss-20b MXFP4 planar", 2880, 2880, 32, 4, (QType.MXFP4,) * 3, SWIGLU_OAI, True, planar=True),
)
SHAPES = tuple(shape for shape in SHAPES if os.environ.get("ONLY", "") in shape.name)


@dataclass(frozen=True)
class Config:
    """A block shape of one kernel ("gate_up", "down"), or of both with their default warps ("whole")."""

    kernel: str
    rows: int
    num_warps: int = 0  # 0: the launcher's own (`warps_for(rows, format)`)
    down_rows: int = 0  # "whole" only
    blocks: int = 0  # blocks of 32 a step of the 32-block formats (0: by the row, `ops.triton.qdot.step_blocks`)

    @property
    def is_default(self) -> bool:
        if self.blocks:
            return False
        if self.kernel == "whole":
            return (self.rows, self.down_rows) == (DEFAULT_CONFIG.gate_up_rows, DEFAULT_CONFIG.down_rows)
        rows = DEFAULT_CONFIG.gate_up_rows if self.kernel == "gate_up" else DEFAULT_CONFIG.down_rows
        return self.rows == rows and self.num_warps == 0

    def __str__(self) -> str:
        blocks = f" blocks {self.blocks}" if self.blocks else ""
        if self.kernel == "whole":
            return f"whole    rows {self.rows:>3}/{self.down_rows:<3} warps default{blocks}"
        return f"{self.kernel:<8} rows {self.rows:>3}     warps {self.num_warps or 'default'}{blocks}"


def kernel_configs(kernel: str, all_rows: tuple[int, ...]) -> list[Config]:
    """Every rows x {default warps, 2x, 4}: first each rows at its default warps, then the others."""
    warps = {rows: dict.fromkeys((warps_for(rows), 2 * warps_for(rows), 4)) for rows in all_rows}
    return [Config(kernel, rows, w) for rank in range(3) for rows in all_rows
            for w in list(warps[rows])[rank : rank + 1]]


def default_configs() -> list[Config]:
    gate_up, down = DEFAULT_CONFIG.gate_up_rows, DEFAULT_CONFIG.down_rows
    return [Config("gate_up", gate_up), Config("down", down),
            Config("whole", gate_up, down_rows=down)]


def blocks_configs() -> list[Config]:
    """The default rows with 8 and 16 blocks of 32 a step (the 32-block formats), at the default warps and twice
    as many as the Q8_0/MXFP4 default (wider steps hold more registers), and the whole FFN with 8."""
    gate_up, down = DEFAULT_CONFIG.gate_up_rows, DEFAULT_CONFIG.down_rows
    return [c for blocks in (8, 16) for c in (Config("gate_up", gate_up, blocks=blocks),
                                              Config("gate_up", gate_up, 2 * warps_for(gate_up), blocks=blocks),
                                              Config("down", down, blocks=blocks),
                                              Config("down", down, 2 * warps_for(down), blocks=blocks))] + \
        [Config("whole", gate_up, down_rows=down, blocks=8)]


def has_blocks(shape: Shape) -> bool:
    """Some of the shape's formats read blocks of 32 (`blocks` changes their loops)."""
    return any(t in (QType.Q8_0, QType.Q4_0, QType.MXFP4) for t in shape.types)


def grid_configs() -> list[Config]:
    """The non-default configs, gate_up's and down's interleaved (a cut budget leaves both half swept)."""
    both = zip_longest(kernel_configs("gate_up", GATE_UP_ROWS), kernel_configs("down", DOWN_ROWS))
    return [c for pair in both for c in pair if c is not None and not c.is_default]


@dataclass(frozen=True)
class Bench:
    """One shape at one batch: the layer's tables, LAUNCHES routings and the buffers the kernels read and write."""

    shape: Shape
    num_tokens: int
    tables: ExpertTables
    x: torch.Tensor  # bf16 [tokens, hidden]
    x_gate: torch.Tensor  # x prepared for the gate and up formats
    x_up: torch.Tensor
    x_sums: torch.Tensor
    h: torch.Tensor  # [pairs, ff], prepared for down (a gate/up launch's output)
    h_sums: torch.Tensor
    y: torch.Tensor  # [pairs, hidden]
    out: torch.Tensor  # [tokens, hidden]
    routings: list[Pairs]  # one per launch of a graph
    num_experts_read: int  # distinct experts over the LAUNCHES routings

    def bytes_read(self, kernel: str) -> int:
        """Expert bytes one graph's launches of `kernel` read (each distinct expert of a launch once)."""
        t = self.tables
        per_expert = {"gate_up": t.ff * (t.gate_row_bytes + t.up_row_bytes), "down": t.hidden * t.down_row_bytes,
                      "whole": t.expert_bytes}[kernel]
        return self.num_experts_read * per_expert


def elapsed() -> float:
    return time.monotonic() - START


def expert_bank(shape: Shape, generator: torch.Generator) -> ExpertWeights:
    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, shape.num_experts * rows * blocks, generator).view(
            shape.num_experts, rows, -1)

    gate_type, up_type, down_type = shape.types
    math = shape.math
    if shape.has_biases:
        def bias(cols: int) -> torch.Tensor:
            return 0.1 * torch.randn(shape.num_experts, cols, generator=generator, device=DEVICE)

        math = replace(math, gate_bias=bias(shape.ff), up_bias=bias(shape.ff), down_bias=bias(shape.hidden))
    bank = ExpertWeights(projection(gate_type, shape.ff, shape.hidden), projection(up_type, shape.ff, shape.hidden),
                         projection(down_type, shape.hidden, shape.ff), gate_type, up_type, down_type, shape.hidden,
                         shape.ff, math)
    return to_planar(bank) if shape.planar else bank


def routed_experts(shape: Shape, num_tokens: int, generator: torch.Generator) -> list[torch.Tensor]:
    """LAUNCHES expert ids `[tokens, top_k]`, a token's distinct, each launch's other than the launch before's
    where the experts suffice."""
    previous, launches = torch.empty(0, dtype=torch.int64), []
    for _ in range(LAUNCHES):
        scores = torch.rand(num_tokens, shape.num_experts, generator=generator)
        scores[:, previous] -= 1
        ids = scores.topk(shape.top_k, dim=1).indices
        launches.append(ids)
        previous = ids.flatten().unique()
    return launches


def pairs_of(expert_ids: torch.Tensor, generator: torch.Generator) -> Pairs:
    num_tokens, top_k = expert_ids.shape
    token_ids = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(top_k)
    weights = torch.rand(num_tokens * top_k, generator=generator)
    return token_ids.to(DEVICE), expert_ids.flatten().to(torch.int32).to(DEVICE), weights.to(DEVICE)


def make_bench(shape: Shape, num_tokens: int, tables: ExpertTables) -> Bench:
    generator = torch.Generator().manual_seed(num_tokens)
    launches = routed_experts(shape, num_tokens, generator)
    routings = [pairs_of(ids, generator) for ids in launches]
    x = torch.randn(num_tokens, shape.hidden, generator=generator).bfloat16().to(DEVICE)
    x_gate, x_sums = launch_prepare(x, tables.gate_type)
    x_up = x_gate if tables.up_type == tables.gate_type else launch_prepare(x, tables.up_type)[0]
    num_pairs = num_tokens * shape.top_k
    h = torch.empty((num_pairs, shape.ff), dtype=torch.float32, device=DEVICE)
    h_sums = torch.empty((num_pairs, shape.ff // GROUP), dtype=torch.float32, device=DEVICE)
    y = torch.empty((num_pairs, shape.hidden), dtype=torch.float32, device=DEVICE)
    out = torch.empty((num_tokens, shape.hidden), dtype=torch.float32, device=DEVICE)
    bench = Bench(shape, num_tokens, tables, x, x_gate, x_up, x_sums, h, h_sums, y, out, routings,
                  sum(ids.unique().numel() for ids in launches))
    token_ids, expert_ids, _ = routings[0]
    launch_gate_up(x_gate, x_up, x_sums, token_ids, expert_ids, tables, h, h_sums)  # h as down reads it
    if reads_int8(tables.down_type):  # ... after its planes are made
        planes, sums = launch_prepare(h, tables.down_type)
        h.copy_(planes)
        h_sums.copy_(sums)
    return bench


def launcher(bench: Bench, config: Config) -> Callable[[int], object]:
    """launch(i): one launch of the config's kernel(s) on routing i."""
    b = bench
    block_tokens = default_block_tokens(b.num_tokens, b.tables.gate_type)
    down_tokens = default_block_tokens(b.num_tokens, b.tables.down_type)

    def gate_up(i: int) -> None:
        token_ids, expert_ids, _ = b.routings[i]
        launch_gate_up(b.x_gate, b.x_up, b.x_sums, token_ids, expert_ids, b.tables, b.h, b.h_sums,
                       block_tokens=block_tokens, block_rows=config.rows, num_warps=config.num_warps or None,
                       blocks=config.blocks)

    def down(i: int) -> None:
        _, expert_ids, weights = b.routings[i]
        launch_down(b.h, b.h_sums, expert_ids, weights, b.tables, b.y, block_tokens=down_tokens,
                    block_rows=config.rows, num_warps=config.num_warps or None, blocks=config.blocks)

    def whole(i: int) -> torch.Tensor:
        launch_config = LaunchConfig(gate_up_rows=config.rows, down_rows=config.down_rows, blocks=config.blocks)
        return grouped_expert_ffn(b.x, *b.routings[i], b.tables, out=b.out, config=launch_config)

    return {"gate_up": gate_up, "down": down, "whole": whole}[config.kernel]


def graph_us(launch: Callable[[int], object], replays: int) -> float:
    """Median microseconds of one launch over `replays` replays of a CUDA graph of launch(0 .. LAUNCHES - 1)."""
    for i in range(LAUNCHES):  # compile, load and warm outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            launch(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1000 / LAUNCHES


class Sweep:
    """Runs (shape, tokens, config) jobs until the budget is spent; keeps each one's microseconds or error."""

    def __init__(self, budget_s: float, replays: int) -> None:
        self.budget_s, self.replays = budget_s, replays
        self.benches: dict[tuple[str, int], Bench] = {}
        self.banks: dict[str, ExpertWeights] = {}  # NOTE: alive while their tables' pointers may be read
        self.tables: dict[str, ExpertTables] = {}
        self.results: dict[tuple[str, int, Config], float | str] = {}
        self.skipped: list[tuple[Shape, int, Config]] = []

    def bench(self, shape: Shape, num_tokens: int) -> Bench:
        if shape.name not in self.tables:
            self.banks[shape.name] = expert_bank(shape, torch.Generator(device=DEVICE).manual_seed(0))
            self.tables[shape.name] = tables_from_bank(self.banks[shape.name], DEVICE)
        key = (shape.name, num_tokens)
        if key not in self.benches:
            self.benches[key] = make_bench(shape, num_tokens, self.tables[shape.name])
        return self.benches[key]

    def run(self, shape: Shape, num_tokens: int, config: Config) -> None:
        if elapsed() > self.budget_s:
            self.skipped.append((shape, num_tokens, config))
            return
        try:
            bench = self.bench(shape, num_tokens)
            us = graph_us(launcher(bench, config), self.replays)
            result: float | str = us
            shown = f"{us:8.1f} us {gb_per_s(bench, config.kernel, us):7.0f} GB/s"
        except Exception as e:  # a config that does not compile or launch: say why, go on
            result = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:160]
            shown = f"failed: {result}"
        self.results[(shape.name, num_tokens, config)] = result
        print(f"{shape.name:<22} {num_tokens:>2} tok  {config}  {shown}  [{elapsed():.1f} s]", flush=True)

    def fastest(self, shape: Shape, num_tokens: int, kernel: str) -> Config | None:
        timed = [(us, c) for (name, tokens, c), us in self.results.items()
                 if (name, tokens, c.kernel) == (shape.name, num_tokens, kernel) and isinstance(us, float)]
        return min(timed, key=lambda t: t[0])[1] if timed else None


def gb_per_s(bench: Bench, kernel: str, us: float) -> float:
    return bench.bytes_read(kernel) / LAUNCHES / us / 1e3


def best_whole(sweep: Sweep, shape: Shape, num_tokens: int) -> Config | None:
    """The whole FFN at the fastest rows of each kernel, if they are not the defaults."""
    gate_up, down = (sweep.fastest(shape, num_tokens, k) for k in ("gate_up", "down"))
    if gate_up is None or down is None:
        return None
    config = Config("whole", gate_up.rows, down_rows=down.rows)
    return None if config.is_default else config


def _order(c: Config) -> tuple[int, ...]:
    return ("gate_up", "down", "whole").index(c.kernel), c.blocks, c.rows, c.down_rows, c.num_warps


def report(sweep: Sweep, shape: Shape) -> None:
    print(f"\n== {shape}", flush=True)
    print(f"{'tok':>3}  {'config':<48} {'us':>8} {'GB/s':>7}")
    for num_tokens in TOKENS:
        bench = sweep.benches.get((shape.name, num_tokens))
        rows = [(c, r) for (name, tokens, c), r in sweep.results.items() if (name, tokens) == (shape.name, num_tokens)]
        fastest = {k: sweep.fastest(shape, num_tokens, k) for k in ("gate_up", "down", "whole")}
        for config, result in sorted(rows, key=lambda cr: _order(cr[0])):
            marks = ("*" if config.is_default else "") + ("<" if fastest[config.kernel] == config else "")
            if isinstance(result, float) and bench is not None:
                shown = f"{result:8.1f} {gb_per_s(bench, config.kernel, result):7.0f}"
            else:
                shown = f"failed: {result}"[:80]
            print(f"{num_tokens:>3}  {config!s:<48} {shown} {marks}")
    print(flush=True)


def report_skipped(sweep: Sweep) -> None:
    if not sweep.skipped:
        return
    print(f"out of time ({sweep.budget_s:.0f} s): skipped {len(sweep.skipped)} jobs:")
    for shape in SHAPES:
        for num_tokens in TOKENS:
            jobs = [c for s, t, c in sweep.skipped if (s.name, t) == (shape.name, num_tokens)]
            if jobs:
                names = ", ".join(f"{c.kernel} {c.rows}{f'/{c.down_rows}' if c.down_rows else ''}"
                                  f"{f' w{c.num_warps}' if c.num_warps else ''}" for c in jobs)
                print(f"  {shape.name} {num_tokens} tok: {names}")


def main(budget_s: float, replays: int) -> None:
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else str(DEVICE)
    print(f"{name}, {LAUNCHES} launches a graph, median of {replays}, budget {budget_s:.0f} s", flush=True)
    sweep = Sweep(budget_s, replays)
    # 1. the defaults: every shape at both batches
    for num_tokens in TOKENS:
        for shape in SHAPES:
            for config in default_configs():
                sweep.run(shape, num_tokens, config)
    # 2. more blocks a step, the shapes with 32-block formats, at both batches
    for num_tokens in TOKENS:
        for config in blocks_configs():
            for shape in filter(has_blocks, SHAPES):
                sweep.run(shape, num_tokens, config)
    # 3. the grid, one config over all shapes at a time, 1 token first
    for num_tokens in TOKENS:
        for config in grid_configs():
            for shape in SHAPES:
                sweep.run(shape, num_tokens, config)
    # 4. the whole FFN at the fastest rows (each kernel's default warps)
    for num_tokens in TOKENS:
        for shape in SHAPES:
            config = best_whole(sweep, shape, num_tokens)
            if config is not None:
                sweep.run(shape, num_tokens, config)
    for shape in SHAPES:
        report(sweep, shape)
    report_skipped(sweep)
    print(f"done in {elapsed():.1f} s", flush=True)


def profiled() -> None:
    """Each shape's default gate/up and down launch at 1 token, then the first shape's (Qwen3-30B-A3B's) at 8 tokens,
    once each inside the profiler's range."""
    sweep = Sweep(float("inf"), 1)
    launches = []
    for shape, num_tokens in [(shape, 1) for shape in SHAPES] + [(SHAPES[0], 8)]:
        bench = sweep.bench(shape, num_tokens)
        for config in default_configs()[:2]:
            launch = launcher(bench, config)
            launch(0)  # compiled and loaded outside the range
            launches.append((shape, config, launch))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, _, launch in launches:
        launch(1)  # other experts than launch 0's
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order:", "; ".join(f"{s.name} {c}" for s, c, _ in launches), flush=True)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs CUDA"
    if sys.argv[1:2] == ["ncu"]:
        profiled()
        sys.exit()
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 50.0, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
