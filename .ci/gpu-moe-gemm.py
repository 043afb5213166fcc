"""The fused prefill expert GEMMs (`ops.triton.moe_gemm`) against the dequantize + grouped GEMM path
(`ops.grouped_gemm`) on one Qwen3-30B-A3B layer (128 experts, gate/up [768 x 2048], down [2048 x 768]) in each
format (Q4_K_M's mix first, then every format of the fused kernels in all three matrices) at 512 and 2048 tokens x
top-8: a table of median milliseconds of `repeats` runs (CUDA events), the speedup and the relative difference of
the two outputs; then, while time is left, a few fused tile configs on the Q4_K_M layer. Decides
`MOECACHE_PREFILL_EXPERTS`'s default. Starts no new format after `budget_s` seconds (a format costs a few seconds,
most of it compiling), so that it ends within a minute on an H200.
With `decode` first: a decode step's sizes instead (1 to 32 tokens x top-8, Q4_K_M's mix): the decode kernels
(`ops.triton.grouped_expert_ffn`) against the fused GEMMs, each the median of `repeats` replays of a CUDA graph of 20
calls, each routed anew (weights mostly from HBM: one layer is 370 MB, L2 50 MB), divided by 20.
PREFILL_CONFIGS=bm:bn:bk:warps:stages,...: the Q4_K_M layer (DECODE_TYPES=T: every matrix T), then those tile
configs.
With `ncu`: the Q4_K_M layer's fused GEMMs at 32 and 512 tokens, once each between cudaProfilerStart and Stop, for
Nsight Compute's counters (`ncu --profile-from-start off --section ... python3 .ci/gpu-moe-gemm.py ncu`).
Usage: python3 .ci/gpu-moe-gemm.py [decode | ncu] [repeats=10] [budget_s=40]  (needs CUDA)"""

import time

START = time.monotonic()

import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402

from ops import quants  # noqa: E402
from ops.bank import ExpertWeights  # noqa: E402
from ops.grouped_gemm import PREFILL_EXPERTS, expert_ffn_grouped_gemm  # noqa: E402
from ops.quants import QType  # noqa: E402
from ops.triton.moe_gemm import MoeGemmConfig, expert_ffn_moe_gemm  # noqa: E402
from ops.triton.qdot import KERNEL_TYPES  # noqa: E402

HIDDEN, FF, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = (512, 2048)
CUDA = torch.device("cuda")
# the most used first: the budget may cut the last ones
ORDER = (QType.Q4_K, QType.MXFP4, QType.Q8_0, QType.Q6_K, QType.Q4_0, QType.Q5_K)
LAYERS = [(QType.Q4_K, QType.Q4_K, QType.Q6_K)] + [(t, t, t) for t in sorted(KERNEL_TYPES, key=ORDER.index)]
# NOTE: block_m 64 and 128: an expert's weights are dequantized once a tile of its pairs, and at 512 tokens (32 pairs
# an expert on average, tiles of 32) about half the experts take two tiles
SWEEP = [MoeGemmConfig(block_m=64), MoeGemmConfig(block_m=128), MoeGemmConfig(block_n=128), MoeGemmConfig(block_k=128),
         MoeGemmConfig(num_stages=3)]
Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def elapsed() -> float:
    return time.monotonic() - START


def bank(types: tuple[QType, QType, QType]) -> ExpertWeights:
    generator = torch.Generator(device=CUDA).manual_seed(0)

    def projection(qtype: QType, rows: int, cols: int) -> torch.Tensor:
        blocks = cols // quants.format_of(qtype).block_size
        return quants.random_blocks(qtype, EXPERTS * rows * blocks, generator).view(EXPERTS, rows, -1)

    gate_type, up_type, down_type = types
    return ExpertWeights(projection(gate_type, FF, HIDDEN), projection(up_type, FF, HIDDEN),
                         projection(down_type, HIDDEN, FF), gate_type, up_type, down_type, HIDDEN, FF)


def routing(num_tokens: int, same: bool = False) -> Pairs:
    """top-8 of random scores per token; `same`: one token's choice for every token (rows that route alike)."""
    scores = torch.rand(1 if same else num_tokens, EXPERTS, device=CUDA).expand(num_tokens, EXPERTS)
    rows = scores.topk(TOP_K, dim=1).indices.flatten()
    tokens = torch.arange(num_tokens, device=CUDA).repeat_interleave(TOP_K)
    return tokens, rows, torch.rand(rows.shape, device=CUDA)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # compile, warm the allocator
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def name(layer: ExpertWeights) -> str:
    return "/".join(t.name for t in (layer.gate_type, layer.up_type, layer.down_type))


def compare(layer: ExpertWeights, num_tokens: int, repeats: int) -> None:
    x = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
    pairs = routing(num_tokens)
    dequant = median_ms(lambda: expert_ffn_grouped_gemm(x, *pairs, layer), repeats)
    fused = median_ms(lambda: expert_ffn_moe_gemm(x, *pairs, layer), repeats)
    a, b = expert_ffn_grouped_gemm(x, *pairs, layer), expert_ffn_moe_gemm(x, *pairs, layer)
    difference = ((a - b).norm() / a.norm()).item()
    print(f"{name(layer):<16} {num_tokens:>6} {dequant:>11.3f} {fused:>9.3f} {dequant / fused:>7.2f}x "
          f"{difference:>9.1e} {elapsed():>6.1f}", flush=True)


def sweep(layer: ExpertWeights, num_tokens: int, repeats: int, budget_s: float, configs: list[MoeGemmConfig]) -> None:
    x = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
    pairs = routing(num_tokens)
    for config in configs:
        if elapsed() > budget_s:
            return
        ms = median_ms(lambda c=config: expert_ffn_moe_gemm(x, *pairs, layer, c), repeats)
        print(f"  sweep {name(layer)} {num_tokens} tokens: {ms:.3f} ms  {config}", flush=True)


def graph_us(calls: Callable[[], object], repeats: int) -> float:
    """Microseconds a call of `calls` (20 calls), replayed as one CUDA graph as the engine replays its steps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()  # compiled and the allocator warmed outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return median_ms(graph.replay, repeats) * 50


def decode(repeats: int) -> None:
    from ops.triton import LaunchConfig, grouped_expert_ffn, tables_from_bank
    # DECODE_TYPES=Q4_K: one format in all three matrices (else Q4_K_M's mix); DECODE_CONFIGS: more launch configs,
    # gate_up_rows:down_rows:block_tokens:blocks[:spread 0|1] each, comma-separated; DECODE_ROUTING=same: every token
    # of a call picks the same experts
    named = os.environ.get("DECODE_TYPES")
    same = os.environ.get("DECODE_ROUTING") == "same"
    layer = bank((QType[named],) * 3 if named else LAYERS[0])
    tables = tables_from_bank(layer, CUDA)
    configs = {"decode kernels": LaunchConfig()}
    for spec in filter(None, os.environ.get("DECODE_CONFIGS", "").split(",")):
        rows, down_rows, block_tokens, blocks, *spread = (int(v) for v in spec.split(":"))
        configs[spec] = LaunchConfig(rows, down_rows, block_tokens or None, blocks, bool(spread[0]) if spread else True)
    print(f"routing: {'every token the same experts' if same else 'random top-8 per token'}")
    print(f"{'tokens':>6} " + " ".join(f"{name + ' us':>17}" for name in configs) + f" {'fused us':>9} {'rel diff':>9}",
          flush=True)
    for num_tokens in (1, 8, 16, 32):
        x = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
        rounds = [routing(num_tokens, same) for _ in range(20)]  # other experts each call: weights from HBM, not L2

        def kernels(config: LaunchConfig, x: torch.Tensor = x, rounds: list[Pairs] = rounds) -> list[torch.Tensor]:
            return [grouped_expert_ffn(x, *r, tables, config=config) for r in rounds]

        def fused(x: torch.Tensor = x, rounds: list[Pairs] = rounds) -> list[torch.Tensor]:
            return [expert_ffn_moe_gemm(x, *r, layer) for r in rounds]

        times = [graph_us(partial(kernels, c), repeats) for c in configs.values()] + [graph_us(fused, repeats)]
        a, b = kernels(LaunchConfig())[0], fused()[0]
        print(f"{num_tokens:>6} " + " ".join(f"{t:>17.1f}" for t in times[:-1]) + f" {times[-1]:>9.1f} "
              f"{((a - b).norm() / a.norm()).item():>9.1e}", flush=True)


def main(repeats: int, budget_s: float) -> None:
    os.environ[PREFILL_EXPERTS] = "dequant"  # expert_ffn_grouped_gemm: the dequantize path
    print(f"{'format g/u/d':<16} {'tokens':>6} {'dequant ms':>11} {'fused ms':>9} {'speedup':>8} "
          f"{'rel diff':>9} {'t (s)':>6}", flush=True)
    skipped = []
    named = os.environ.get("DECODE_TYPES")  # one format in all three matrices (else every layer of LAYERS)
    # PREFILL_CONFIGS: the Q4_K_M layer alone, then these tile configs (block_m:block_n:block_k:warps:stages, comma-
    # separated) in place of SWEEP, whatever the budget
    configs = [MoeGemmConfig(*(int(v) for v in spec.split(":")))
               for spec in filter(None, os.environ.get("PREFILL_CONFIGS", "").split(","))]
    for types in [(QType[named],) * 3] if named else LAYERS[:1] if configs else LAYERS:
        if elapsed() > budget_s:
            skipped.append("/".join(t.name for t in types))
            continue
        layer = bank(types)
        for num_tokens in TOKENS:
            compare(layer, num_tokens, repeats)
    if skipped:
        print(f"out of time ({budget_s:.0f} s), skipped: {', '.join(skipped)}", flush=True)
    if elapsed() < budget_s or configs:
        layer = bank((QType[named],) * 3 if named else LAYERS[0])
        for num_tokens in TOKENS:
            sweep(layer, num_tokens, repeats, float("inf") if configs else budget_s, configs or SWEEP)
    print(f"done in {elapsed():.1f} s", flush=True)


def profiled() -> None:
    """The Q4_K_M layer's fused GEMMs at 32 and 512 tokens x top-8, once each inside the profiler's range (compiled and
    warmed outside it), for Nsight Compute (`ncu --profile-from-start off`)."""
    layer = bank(LAYERS[0])
    calls = []
    for num_tokens in (32, 512):
        x = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
        pairs = routing(num_tokens)
        expert_ffn_moe_gemm(x, *pairs, layer)
        calls.append((x, routing(num_tokens)))  # other experts than the warm-up's
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for x, pairs in calls:
        expert_ffn_moe_gemm(x, *pairs, layer)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order: the fused GEMMs of 32 and of 512 tokens (Q4_K/Q4_K/Q6_K)", flush=True)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs CUDA"
    if sys.argv[1:2] == ["ncu"]:
        profiled()
        sys.exit()
    if sys.argv[1:2] == ["decode"]:
        decode(int(sys.argv[2]) if len(sys.argv) > 2 else 10)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, float(sys.argv[2]) if len(sys.argv) > 2 else 40.0)
