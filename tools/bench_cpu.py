"""CPU expert FFN throughput: `python -m tools.bench_cpu [--threads N]`, and the measurements `moecache bench`
reports as the machine's CPU ceilings (`benchmark_cpu_experts`, `memory_bandwidth_gbps`)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypedDict

import numpy as np
import torch

from ops.bank import ExpertWeights, random_expert_weights
from ops.cpu_experts import QType, expert_ffn_cpu, load_native
from ops.expert_math import Activation, ExpertMath


class BenchmarkResult(TypedDict):
    seconds: float  # median per layer call
    gbps: float  # bytes of the distinct experts a call touches / seconds, median over calls
    gflops: float  # 6 * hidden * ff flops per pair / median seconds
    num_pairs: int
    path: str  # "native-<simd>" or "torch"


def random_routing(
    rng: np.random.Generator, num_tokens: int, top_k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_ids, expert_ids, weights [num_tokens * top_k]: top_k distinct experts per token."""
    experts = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
    weights = torch.from_numpy(rng.dirichlet(np.ones(top_k), num_tokens).astype(np.float32))
    token_ids = torch.arange(num_tokens).repeat_interleave(top_k)
    return token_ids, torch.from_numpy(experts.reshape(-1)), weights.reshape(-1)


def benchmark_cpu_experts(
    hidden: int = 2048,
    ff: int = 768,
    num_experts: int = 128,
    top_k: int = 8,
    num_tokens: int = 1,
    qtype: QType = QType.Q4_K,
    down_type: QType | None = None,
    num_threads: int | None = None,
    repeats: int = 30,
    seed: int = 0,
    activation: Activation = "silu",
    biases: bool = False,
) -> BenchmarkResult:
    """One layer call per repeat, a fresh random routing each time, so experts come from DRAM. `activation` and
    `biases` (gate, up and down, by expert id) set the bank's `ExpertMath`."""
    w = with_math(random_expert_weights(num_experts, hidden, ff, qtype, qtype, down_type or qtype, seed),
                  activation, biases)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((num_tokens, hidden), dtype=np.float32))
    seconds, rates = [], []
    for i in range(repeats + 1):
        token_ids, expert_ids, weights = random_routing(rng, num_tokens, top_k, num_experts)
        start = time.perf_counter()
        expert_ffn_cpu(x, token_ids, expert_ids, weights, w, num_threads=num_threads)
        elapsed = time.perf_counter() - start
        if i:  # the first call builds the library and warms the threads
            seconds.append(elapsed)
            rates.append(len(set(expert_ids.tolist())) * w.expert_bytes / elapsed)
    median = statistics.median(seconds)
    lib = load_native()
    return {
        "seconds": median,
        "gbps": statistics.median(rates) / 1e9,
        "gflops": 6 * hidden * ff * num_tokens * top_k / median / 1e9,
        "num_pairs": num_tokens * top_k,
        "path": f"native-{lib.simd}" if lib is not None and lib.supports(w) else "torch",
    }


def with_math(w: ExpertWeights, activation: Activation, biases: bool) -> ExpertWeights:
    bias = (lambda n: torch.randn(w.num_experts, n) * 0.1) if biases else (lambda n: None)
    return replace(w, math=ExpertMath(activation, bias(w.ff), bias(w.ff), bias(w.hidden)))


def memory_bandwidth_gbps(num_bytes: int = 1 << 30) -> dict[str, float]:
    """This machine's memory read (torch sum) and copy (bytes read + written) rates, best of 5."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = min(_timed(lambda: src.sum()) for _ in range(5))
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return {"read": num_bytes / read / 1e9, "copy": 2 * num_bytes / copy / 1e9}


def torch_int4_gemv_gbps(
    rows: int = 768, cols: int = 2048, num_matrices: int = 256, num_tokens: int = 1, num_threads: int | None = None
) -> float:
    """torch's int4 CPU GEMV (group 32, bf16) over a pool of matrices larger than the caches: GB/s."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or saved_threads)
    try:
        return _int4_sweep_gbps(rows, cols, num_matrices, num_tokens)
    finally:
        torch.set_num_threads(saved_threads)


def _int4_sweep_gbps(rows: int, cols: int, num_matrices: int, num_tokens: int) -> float:
    group = 32
    packed = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (rows, cols), dtype=torch.int32), 2)
        for _ in range(num_matrices)
    ]
    scales = torch.rand(cols // group, rows, 2, dtype=torch.bfloat16)
    x = torch.randn(num_tokens, cols, dtype=torch.bfloat16)

    def sweep() -> None:
        for p in packed:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, group, scales)

    sweep()
    matrix_bytes = rows * cols // 2 + scales.numel() * scales.element_size()
    return num_matrices * matrix_bytes / min(_timed(sweep) for _ in range(3)) / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="CPU expert FFN throughput, Qwen3-30B-A3B and gpt-oss-20b layers")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    args = parser.parse_args(argv)
    bw = memory_bandwidth_gbps()
    print(f"memory: read {bw['read']:.1f} GB/s, copy {bw['copy']:.1f} GB/s ({torch.get_num_threads()} threads)")
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        for n in (1, 8):
            gbps = torch_int4_gemv_gbps(num_tokens=n, num_threads=args.threads)
            print(f"torch int4 GEMV 768x2048, group 32, batch {n}: {gbps:.1f} GB/s")
    layouts = (
        (QType.Q4_K, QType.Q4_K),
        (QType.Q4_K, QType.Q6_K),
        (QType.Q5_K, QType.Q5_K),
        (QType.Q6_K, QType.Q6_K),
        (QType.Q8_0, QType.Q8_0),
        (QType.Q4_0, QType.Q4_0),
        (QType.MXFP4, QType.MXFP4),
    )
    for qtype, down_type in layouts:
        for n in (1, 8):
            r = benchmark_cpu_experts(num_tokens=n, qtype=qtype, down_type=down_type, num_threads=args.threads)
            _report(f"{qtype.name} gate/up + {down_type.name} down, batch {n}", r)
    for n in (1, 8):  # gpt-oss-20b's layer: 32 experts of 2880 x 2880, top-4, biases and the clamped SwiGLU
        r = benchmark_cpu_experts(2880, 2880, 32, 4, n, QType.MXFP4, num_threads=args.threads,
                                  activation="swiglu_oai", biases=True)
        _report(f"gpt-oss-20b MXFP4 + biases + swiglu_oai, batch {n}", r)


def _report(case: str, r: BenchmarkResult) -> None:
    print(f"{case}: {r['seconds'] * 1e6:7.0f} us {r['gbps']:6.1f} GB/s {r['gflops']:6.1f} GFLOP/s ({r['path']})",
          flush=True)


if __name__ == "__main__":
    main()
