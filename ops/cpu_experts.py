"""Routed-expert FFN of one MoE layer computed on the CPU from raw GGUF bytes.

`expert_ffn_cpu` runs the C kernel of `ops/csrc/cpu_experts.c` (Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16,
F32; AVX-512 VNNI, AVX2 or portable C, picked at compile time) in one call per layer, and falls back
to torch (row tiles dequantized with `ops.quants`) for other types or when no C compiler is present.
The kernel runs on a persistent native worker pool (`NativeExperts.start_pool`) with the calling thread.
`ExpertTask` is the same computation as a native task a CUDA graph's host node runs (`cuLaunchHostFunc`
with `ExpertTask.function_address` and `ExpertTask.address`): no Python and no GIL on that path.
`expert_ffn_reference` is the slow, obviously-correct twin used by the tests.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import gguf.quants
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ops import native, quants

QType = GGMLQuantizationType
SOURCE = native.CSRC / "cpu_experts.c"
TILE_ROWS = 256  # rows dequantized at a time by the torch path
_SIMD_NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}
_ERRORS = {
    -1: "unsupported tensor type",
    -2: "bad shape (a row length not a multiple of the block size, or more tokens than the buffers)",
    -3: "token id out of range",
    -4: "expert id out of range",
    -5: "out of memory",
}


def row_bytes(qtype: QType, num_cols: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if num_cols % block_size:
        raise ValueError(f"{qtype.name}: row of {num_cols} is not a multiple of {block_size}")
    return num_cols // block_size * type_size


@dataclass(frozen=True)
class ExpertWeights:
    """A bank of routed experts as raw GGUF bytes (contiguous uint8), first dimension = expert or slot:
    a layer in host memory, a layer resident on the device, or a pool of cache slots."""

    gate: torch.Tensor  # [num_experts, ff, row_bytes(gate_type, hidden)]
    up: torch.Tensor  # [num_experts, ff, row_bytes(up_type, hidden)]
    down: torch.Tensor  # [num_experts, hidden, row_bytes(down_type, ff)]
    gate_type: QType
    up_type: QType
    down_type: QType
    hidden: int
    ff: int

    def __post_init__(self) -> None:
        for name, qtype in (
            ("gate_type", self.gate_type),
            ("up_type", self.up_type),
            ("down_type", self.down_type),
        ):
            object.__setattr__(self, name, QType(qtype))
        num_experts = self.gate.shape[0]
        self._check("gate", self.gate, (num_experts, self.ff, row_bytes(self.gate_type, self.hidden)))
        self._check("up", self.up, (num_experts, self.ff, row_bytes(self.up_type, self.hidden)))
        self._check("down", self.down, (num_experts, self.hidden, row_bytes(self.down_type, self.ff)))

    @staticmethod
    def _check(name: str, t: torch.Tensor, shape: tuple[int, int, int]) -> None:
        if t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous uint8 bytes, got {t.dtype} on {t.device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down)."""
        return (self.gate[0].numel() + self.up[0].numel() + self.down[0].numel()) * self.gate.element_size()


class MoeTaskStruct(ctypes.Structure):
    """Mirror of `struct moe_task` in ops/csrc/cpu_experts.c (checked against its size at load)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("x", "expert_ids", "weights", "on_cpu", "num_tokens", "out")),
        *((name, ctypes.c_int64) for name in ("max_tokens", "top_k", "hidden", "ff", "num_experts")),
        *((name, ctypes.c_void_p) for name in ("gate", "up", "down")),
        *((name, ctypes.c_int32) for name in ("gate_type", "up_type", "down_type", "num_threads", "error", "reserved")),
        *((name, ctypes.c_int64) for name in ("calls", "pairs", "experts", "bytes", "busy_ns")),
    ]


class NativeExperts:
    """Typed launcher for the compiled kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._ffn = lib.moe_expert_ffn
        # x, num_tokens, token_ids, expert_ids, weights, num_pairs, gate, up, down, gate_type, up_type,
        # down_type, num_experts, hidden, ff, out, num_threads
        self._ffn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i64, i64, i64, ptr, i32]
        self._ffn.restype = ctypes.c_int
        lib.moe_supports_type.argtypes = [ctypes.c_int]
        self._supports = lib.moe_supports_type
        self.simd = _SIMD_NAMES[lib.moe_simd_level()]
        lib.moe_pool_start.argtypes, lib.moe_pool_reserve.argtypes = [i32, i32], [i32]
        self._pool_start, self._pool_reserve = lib.moe_pool_start, lib.moe_pool_reserve
        self._pool_threads = lib.moe_pool_threads
        lib.moe_task_size.restype = ctypes.c_size_t
        self.task_run = lib.moe_task_run
        self.task_run.argtypes, self.task_run.restype = [ptr], None
        if ctypes.sizeof(MoeTaskStruct) != lib.moe_task_size():
            raise RuntimeError("MoeTaskStruct does not match struct moe_task in ops/csrc/cpu_experts.c")

    def supports(self, w: ExpertWeights) -> bool:
        return all(self._supports(int(t)) for t in (w.gate_type, w.up_type, w.down_type))

    def start_pool(self, num_threads: int | None = None, spin_us: int | None = None) -> int:
        """Size the worker pool (threads per layer, the caller included; default: one per core) and how long
        idle workers spin before they sleep; returns the pool's thread count. Calls may ask for fewer."""
        return int(self._pool_start(num_threads or 0, -1 if spin_us is None else spin_us))

    def reserve_threads(self, num_threads: int | None = None) -> int:
        """Start the threads a layer of num_threads (default: the pool's) needs now rather than at its first call."""
        return int(self._pool_reserve(num_threads or 0))

    @property
    def pool_threads(self) -> int:
        return int(self._pool_threads())

    def ffn(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        w: ExpertWeights,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        x, token_ids, expert_ids, weights = _checked(x, token_ids, expert_ids, weights, w)
        out = torch.empty_like(x)  # the kernel writes every row
        rc = self._ffn(
            x.data_ptr(),
            x.shape[0],
            token_ids.data_ptr(),
            expert_ids.data_ptr(),
            weights.data_ptr(),
            token_ids.shape[0],
            w.gate.data_ptr(),
            w.up.data_ptr(),
            w.down.data_ptr(),
            int(w.gate_type),
            int(w.up_type),
            int(w.down_type),
            w.num_experts,
            w.hidden,
            w.ff,
            out.data_ptr(),
            num_threads or 0,
        )
        if rc:
            raise ValueError(f"expert_ffn_cpu: {_ERRORS.get(rc, f'error {rc}')}")
        return out


@dataclass(frozen=True)
class TaskCounters:
    """Cumulative over an ExpertTask's runs; `bytes` counts each run's distinct experts once."""

    calls: int
    pairs: int
    experts: int
    bytes: int
    busy_ns: int
    error: int  # of the last run: 0, or the kernel's error code


def _host_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"{name}: expected contiguous {dtype} host tensor of {numel} elements, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t


class ExpertTask:
    """One layer's CPU-computed pairs as a native task (`struct moe_task`), for a CUDA graph's host node:
    `cuLaunchHostFunc(stream, function_address, address)`; `run()` makes the same call from Python.

    The task reads its inputs when it runs (pinned tensors a GPU kernel writes before the host node):
    x float32 [max_tokens, hidden]; expert_ids int32, weights float32, on_cpu int32 [max_tokens, top_k]
    (pair p is token p // top_k's; it is computed where on_cpu[p] != 0 and expert_ids[p] >= 0);
    num_tokens int32 [1]. It writes out float32 [max_tokens, hidden] rows < num_tokens: the weighted sum of
    the flagged pairs, bit-identical to `expert_ffn_cpu` on them. The tensors are kept alive here.
    """

    def __init__(self, w: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 on_cpu: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor, *,
                 num_threads: int | None = None, lib: NativeExperts | None = None) -> None:
        lib = lib or load_native()
        if lib is None or not lib.supports(w) or w.gate.device.type != "cpu":
            raise ValueError("ExpertTask needs the native kernel, a supported type and experts in host memory")
        max_tokens, pairs = (x.shape[0] if x.dim() == 2 else 0), expert_ids.numel()
        if max_tokens == 0 or x.shape[1] != w.hidden or pairs % max_tokens:
            raise ValueError(f"x [max_tokens, {w.hidden}] and expert_ids [max_tokens, top_k] do not match")
        _host_tensor("x", x, torch.float32, max_tokens * w.hidden)
        _host_tensor("out", out, torch.float32, max_tokens * w.hidden)
        for name, t, dtype in (("expert_ids", expert_ids, torch.int32), ("weights", weights, torch.float32),
                               ("on_cpu", on_cpu, torch.int32)):
            _host_tensor(name, t, dtype, pairs)
        _host_tensor("num_tokens", num_tokens, torch.int32, 1)
        lib.reserve_threads(num_threads)  # not on the first run, in a CUDA driver's thread
        self._lib, self._tensors = lib, (w, x, expert_ids, weights, on_cpu, num_tokens, out)
        self.struct = MoeTaskStruct(
            x.data_ptr(), expert_ids.data_ptr(), weights.data_ptr(), on_cpu.data_ptr(), num_tokens.data_ptr(),
            out.data_ptr(), max_tokens, pairs // max_tokens, w.hidden, w.ff, w.num_experts, w.gate.data_ptr(),
            w.up.data_ptr(), w.down.data_ptr(), int(w.gate_type), int(w.up_type), int(w.down_type),
            num_threads or 0)

    @property
    def address(self) -> int:
        """Address of the `struct moe_task`: the host function's argument."""
        return ctypes.addressof(self.struct)

    @property
    def function_address(self) -> int:
        """Address of `void moe_task_run(void *)`."""
        return int(ctypes.cast(self._lib.task_run, ctypes.c_void_p).value or 0)

    def run(self) -> None:
        """Compute the flagged pairs now (the GIL released); raises ValueError on bad ids (out then 0)."""
        self._lib.task_run(self.address)
        if self.struct.error:
            raise ValueError(f"ExpertTask: {_ERRORS.get(self.struct.error, f'error {self.struct.error}')}")

    @property
    def counters(self) -> TaskCounters:
        s = self.struct
        return TaskCounters(s.calls, s.pairs, s.experts, s.bytes, s.busy_ns, s.error)


_wrap = functools.cache(NativeExperts)


def load_native(extra_flags: tuple[str, ...] = ()) -> NativeExperts | None:
    """The kernel built with `extra_flags` (e.g. `-DMOECACHE_SCALAR`); None when it cannot be built."""
    lib = native.load_library(SOURCE, extra_flags)
    return None if lib is None else _wrap(lib)


def native_available() -> bool:
    return load_native() is not None


def _checked(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w: ExpertWeights,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.hidden or x.device.type != "cpu":
        raise ValueError(f"x: expected float32 CPU [num_tokens, {w.hidden}], got {x.dtype} {tuple(x.shape)}")
    if any(t.device.type != "cpu" for t in (w.gate, w.up, w.down)):
        raise ValueError(f"expert bytes must be in host memory, got {w.gate.device}")
    ids = [t.to(torch.int64).contiguous() for t in (token_ids, expert_ids)]
    weights = weights.to(torch.float32).contiguous()
    if not ids[0].shape == ids[1].shape == weights.shape or ids[0].dim() != 1:
        raise ValueError("token_ids, expert_ids and weights must be 1-D of the same length")
    return x.contiguous(), ids[0], ids[1], weights


def expert_ffn_cpu(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w: ExpertWeights,
    *,
    num_threads: int | None = None,
) -> torch.Tensor:
    """out[t] = sum over pairs p with token_ids[p] == t of weights[p] * down_e(silu(gate_e(x_t)) * up_e(x_t)).

    x: float32 [num_tokens, hidden]; token_ids, expert_ids: int64 [num_pairs]; weights: float32 [num_pairs].
    Returns float32 [num_tokens, hidden]. `num_threads` sizes the native kernel's team (default: all cores).
    """
    lib = load_native()
    if lib is not None and lib.supports(w):
        return lib.ffn(x, token_ids, expert_ids, weights, w, num_threads)
    return expert_ffn_tiled(x, token_ids, expert_ids, weights, w)


def _tiled_matmul(a: torch.Tensor, raw: torch.Tensor, qtype: QType, num_cols: int) -> torch.Tensor:
    """a [n, num_cols] @ W.T for W = raw bytes [rows, row_bytes], dequantized TILE_ROWS rows at a time."""
    tiles = [
        a @ quants.dequantize(raw[r : r + TILE_ROWS], qtype, num_cols).T for r in range(0, raw.shape[0], TILE_ROWS)
    ]
    return torch.cat(tiles, dim=1)


def expert_ffn_tiled(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w: ExpertWeights,
) -> torch.Tensor:
    """The torch path of `expert_ffn_cpu`: pairs grouped by expert, each expert read in row tiles."""
    x, token_ids, expert_ids, weights = _checked(x, token_ids, expert_ids, weights, w)
    out = torch.zeros_like(x)
    order = torch.argsort(expert_ids, stable=True)
    experts, counts = torch.unique_consecutive(expert_ids[order], return_counts=True)
    for e, pairs in zip(experts.tolist(), torch.split(order, counts.tolist()), strict=True):
        tokens = token_ids[pairs]
        rows = x[tokens]  # [n, hidden]
        gate = _tiled_matmul(rows, w.gate[e], w.gate_type, w.hidden)  # [n, ff]
        h = F.silu(gate) * _tiled_matmul(rows, w.up[e], w.up_type, w.hidden)
        out.index_add_(0, tokens, _tiled_matmul(h, w.down[e], w.down_type, w.ff) * weights[pairs, None])
    return out


def _dequantize_reference(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), qtype), dtype=np.float32))


def expert_ffn_reference(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w: ExpertWeights,
) -> torch.Tensor:
    """Same result as `expert_ffn_cpu`: whole experts dequantized by gguf's numpy code, fp32 per pair."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    dense: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t, e, weight in zip(token_ids.tolist(), expert_ids.tolist(), weights.tolist(), strict=True):
        if e not in dense:
            dense[e] = (
                _dequantize_reference(w.gate[e], w.gate_type),
                _dequantize_reference(w.up[e], w.up_type),
                _dequantize_reference(w.down[e], w.down_type),
            )
        gate, up, down = dense[e]
        xt = x[t].float()
        out[t] += weight * (down @ (F.silu(gate @ xt) * (up @ xt)))
    return out


# byte offsets of the fp16 scale fields (d, dmin) in one block of each format
SCALE_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}
_FLOAT_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


def random_rows(rng: np.random.Generator, num_rows: tuple[int, int], num_cols: int, qtype: QType) -> torch.Tensor:
    """Valid random bytes uint8 [*num_rows, row_bytes]: random blocks with small finite fp16 scales."""
    if qtype in _FLOAT_DTYPES:
        values = torch.from_numpy(rng.standard_normal((*num_rows, num_cols), dtype=np.float32) * 0.05)
        return values.to(_FLOAT_DTYPES[qtype]).view(torch.uint8).contiguous()
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*num_rows, num_cols // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scales = rng.uniform(1e-4, 1e-3, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    return torch.from_numpy(blocks.reshape(*num_rows, -1))


def random_expert_weights(
    num_experts: int,
    hidden: int,
    ff: int,
    gate_type: QType,
    up_type: QType | None = None,
    down_type: QType | None = None,
    seed: int = 0,
) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    up_type, down_type = up_type or gate_type, down_type or gate_type
    return ExpertWeights(
        gate=random_rows(rng, (num_experts, ff), hidden, gate_type),
        up=random_rows(rng, (num_experts, ff), hidden, up_type),
        down=random_rows(rng, (num_experts, hidden), ff, down_type),
        gate_type=gate_type,
        up_type=up_type,
        down_type=down_type,
        hidden=hidden,
        ff=ff,
    )


# ---- throughput ----


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
) -> BenchmarkResult:
    """One layer call per repeat, a fresh random routing each time, so experts come from DRAM."""
    w = random_expert_weights(num_experts, hidden, ff, qtype, qtype, down_type or qtype, seed)
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
    parser = argparse.ArgumentParser(description="CPU expert FFN throughput, one Qwen3-30B-A3B-shaped layer")
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
    )
    for qtype, down_type in layouts:
        for n in (1, 8):
            r = benchmark_cpu_experts(num_tokens=n, qtype=qtype, down_type=down_type, num_threads=args.threads)
            print(
                f"{qtype.name} gate/up + {down_type.name} down, batch {n}: {r['seconds'] * 1e6:7.0f} us"
                f" {r['gbps']:6.1f} GB/s {r['gflops']:6.1f} GFLOP/s ({r['path']})",
                flush=True,
            )


if __name__ == "__main__":
    main()
