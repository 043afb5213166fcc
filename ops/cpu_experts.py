"""Routed-expert FFN of one MoE layer computed on the CPU from raw GGUF bytes.

`expert_ffn_cpu` runs the C kernel of `ops/csrc/cpu_experts.c` (Q4_K, Q5_K, Q6_K, Q4_0, Q8_0, MXFP4, F16,
BF16, F32; AVX-512 VNNI, AVX2 or portable C, picked at compile time) in one call per layer, and falls back
to torch (row tiles dequantized with `ops.quants`) for other types or when no C compiler is present.
The kernel runs on a persistent native worker pool (`NativeExperts.start_pool`) with the calling thread.
The kernel computes the bank's `ExpertMath` (biases by expert id; silu, gpt-oss's clamped SwiGLU or the
tanh GELU). `ExpertTask` is the same computation as a native task, which `BellWatcher`'s thread runs when a
device kernel rings for it in the middle of a CUDA graph: no Python, no GIL and no CUDA call on that path.
`ops.expert_ffn.expert_ffn_reference` is the slow, obviously-correct twin the tests check it against.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from ops import native, quants
from ops.bank import ExpertWeights, gguf_experts
from ops.cache_step import Bell
from ops.expert_math import ExpertMath

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
    -6: "unsupported activation",
}
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1, "gelu": 2}  # MOE_SILU, MOE_SWIGLU_OAI, MOE_GELU of ops/csrc/layer.h


class MoeMathStruct(ctypes.Structure):
    """Mirror of `struct moe_math` in ops/csrc/layer.h."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("gate_bias", "up_bias", "down_bias")),
        ("activation", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
        ("reserved", ctypes.c_int32),
    ]


def _bias(name: str, t: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    if t is None:
        return None
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected {shape}, got {tuple(t.shape)}")
    return t.to("cpu", torch.float32).contiguous()


def math_struct(math: ExpertMath, w: ExpertWeights) -> tuple[MoeMathStruct, tuple[torch.Tensor | None, ...]]:
    """The kernel's view of `math` for bank `w`, and the float32 host biases it points to (keep them alive)."""
    biases = (_bias("gate_bias", math.gate_bias, (w.num_experts, w.ff)),
              _bias("up_bias", math.up_bias, (w.num_experts, w.ff)),
              _bias("down_bias", math.down_bias, (w.num_experts, w.hidden)))
    pointers = (None if b is None else b.data_ptr() for b in biases)
    return MoeMathStruct(*pointers, ACTIVATIONS[math.activation], math.alpha, math.limit), biases


class MoeTaskStruct(ctypes.Structure):
    """Mirror of `struct moe_task` in ops/csrc/cpu_experts.c (checked against its size at load)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("x", "expert_ids", "weights", "on_cpu", "num_tokens", "out")),
        *((name, ctypes.c_int64) for name in ("max_tokens", "top_k", "hidden", "ff", "num_experts")),
        *((name, ctypes.c_void_p) for name in ("gate", "up", "down")),
        ("strides", ctypes.c_int64 * 3),
        ("math", MoeMathStruct),
        *((name, ctypes.c_int32) for name in ("gate_type", "up_type", "down_type", "num_threads", "error", "reserved")),
        *((name, ctypes.c_int64) for name in ("calls", "pairs", "experts", "bytes", "busy_ns")),
    ]


def expert_strides(w: ExpertWeights) -> ctypes.Array[ctypes.c_int64]:
    """Bytes from one expert to the next in the gate, up and down tensors (views of merged gate/up step over the
    other half)."""
    return (ctypes.c_int64 * 3)(*(t.stride(0) * t.element_size() for t in (w.gate, w.up, w.down)))


class NativeExperts:
    """Typed launcher for the compiled kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._ffn = lib.moe_expert_ffn
        # x, num_tokens, token_ids, expert_ids, weights, num_pairs, gate, up, down, gate_type, up_type,
        # down_type, num_experts, hidden, ff, out, num_threads, math, strides
        self._ffn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i64, i64, i64, ptr, i32,
                              ctypes.POINTER(MoeMathStruct), ctypes.POINTER(ctypes.c_int64 * 3)]
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
        lib.moe_bell_start.argtypes = [ptr, ptr, ctypes.POINTER(ctypes.c_void_p), i64, i64]
        lib.moe_bell_start.restype = ptr
        lib.moe_bell_stop.argtypes, lib.moe_bell_stop.restype = [ptr], None
        lib.moe_bell_answered.argtypes, lib.moe_bell_answered.restype = [ptr], i64
        self.bell_start, self.bell_stop, self.bell_answered = lib.moe_bell_start, lib.moe_bell_stop, \
            lib.moe_bell_answered
        if ctypes.sizeof(MoeTaskStruct) != lib.moe_task_size():
            raise RuntimeError("MoeTaskStruct does not match struct moe_task in ops/csrc/cpu_experts.c")

    def supports(self, w: ExpertWeights) -> bool:
        """The bank's types and its math's activation have a native kernel (which reads GGUF's blocks)."""
        types = all(self._supports(int(t)) for t in (w.gate_type, w.up_type, w.down_type))
        return types and w.math.activation in ACTIVATIONS and not w.planar

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
        math, _biases = math_struct(w.math, w)  # NOTE: _biases keeps the pointed-to tensors alive for the call
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
            ctypes.byref(math),
            ctypes.byref(expert_strides(w)),
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
    """One layer's CPU-computed pairs as a native task (`struct moe_task`) that `BellWatcher` runs when a
    device kernel rings for it (`moe_task_run(address)`); `run()` makes the same call from Python.

    The task reads its inputs when it runs (pinned tensors a GPU kernel writes before it rings):
    x float32 [max_tokens, hidden]; expert_ids int32, weights float32, on_cpu int32 [max_tokens, top_k]
    (pair p is token p // top_k's; it is computed where on_cpu[p] != 0 and expert_ids[p] >= 0);
    num_tokens int32 [1]. It writes out float32 [max_tokens, hidden] rows < num_tokens: the weighted sum of
    the flagged pairs under the bank's math, bit-identical to `expert_ffn_cpu` on them. The tensors are kept
    alive here.
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
        math, biases = math_struct(w.math, w)
        lib.reserve_threads(num_threads)  # not on the first run, in a CUDA driver's thread
        self._lib, self._tensors = lib, (w, x, expert_ids, weights, on_cpu, num_tokens, out, *biases)
        self.struct = MoeTaskStruct(
            x.data_ptr(), expert_ids.data_ptr(), weights.data_ptr(), on_cpu.data_ptr(), num_tokens.data_ptr(),
            out.data_ptr(), max_tokens, pairs // max_tokens, w.hidden, w.ff, w.num_experts, w.gate.data_ptr(),
            w.up.data_ptr(), w.down.data_ptr(), expert_strides(w), math, int(w.gate_type), int(w.up_type),
            int(w.down_type), num_threads or 0)

    @property
    def address(self) -> int:
        """Address of the `struct moe_task`: the argument of `moe_task_run`."""
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


class BellWatcher:
    """The native thread that answers a device's rings (`ops.cache_step.Bell`, `ops/csrc/bell.h`): when the ring
    word `words[RING]` changes to seq << TASK_BITS | i, it runs `tasks[i]` (None: nothing) and writes seq to
    `words[DONE]`. It spins `spin_us` after each answer, then polls with sleeps. `close()` stops it; the tasks
    and the words must live until then (kept here)."""

    def __init__(self, words: torch.Tensor, tasks: Sequence[ExpertTask | None], spin_us: int,
                 lib: NativeExperts | None = None) -> None:
        lib = lib or load_native()
        if lib is None:
            raise ValueError("BellWatcher needs the native kernel")
        _host_tensor("words", words, torch.int64, 16)
        addresses = (ctypes.c_void_p * max(len(tasks), 1))(*(t.address if t is not None else None for t in tasks))
        self._lib, self._keep = lib, (words, list(tasks))
        ring, done = (words.data_ptr() + 8 * i for i in (Bell.RING, Bell.DONE))
        self._handle = lib.bell_start(ring, done, addresses, len(tasks), spin_us)
        if not self._handle:
            raise RuntimeError(f"could not start the bell watcher for {len(tasks)} tasks")

    @property
    def answered(self) -> int:
        """Rings answered so far."""
        return int(self._lib.bell_answered(self._handle)) if self._handle else 0

    def close(self) -> None:
        if self._handle:
            self._lib.bell_stop(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


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
    """out[t] = sum over pairs p with token_ids[p] == t of weights[p] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
    or what the bank's `ExpertMath` computes between the matrices.

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
        rows, bank_rows = x[tokens], torch.full_like(tokens, e)  # [n, hidden], [n]
        raw_gate, raw_up, raw_down = (t[0] for t in gguf_experts(w, slice(e, e + 1)))
        gate = _tiled_matmul(rows, raw_gate, w.gate_type, w.hidden)  # [n, ff]
        h = w.math.hidden(gate, _tiled_matmul(rows, raw_up, w.up_type, w.hidden), bank_rows)
        y = w.math.output(_tiled_matmul(h, raw_down, w.down_type, w.ff), bank_rows)
        out.index_add_(0, tokens, y * weights[pairs, None])
    return out
