"""The machine's ceilings, measured once per run: the rates that bound a decode step.

On a CUDA device: pinned host -> device copy (PCIe), a device kernel reading pinned host memory in place
(zero-copy, the Triton gather of `ops.triton`; n/a without Triton), device memory (a large
device-to-device copy, bytes read + written), host memory read, and the CPU expert kernel on this
model's expert shape, and on CUDA the link and the CPU expert kernel reading host memory at once (both share the
host's memory controllers, so together they read less than the sum of their rates alone). Without an accelerator
the "device" is the host, so its ceilings are the host's: a host memory copy for the link, a host memory read for
zero-copy, a host copy (read + written) for HBM.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.expert_cache.split import measure_link_gbps, measure_shared_gbps
from ops.bank import ExpertWeights, row_bytes
from ops.quants import QType
from tools.bench_cpu import benchmark_cpu_experts, memory_bandwidth_gbps

HOST_BYTES = 256 << 20  # per host measurement: far beyond the last-level cache
DEVICE_BYTES = 1 << 30  # per device-memory copy


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert of the model, for the CPU kernel's benchmark."""

    hidden: int
    ff: int
    num_experts: int
    top_k: int
    gate_type: QType  # of gate and up
    down_type: QType

    @classmethod
    def of(cls, bank: ExpertWeights, top_k: int) -> ExpertShape:
        return cls(bank.hidden, bank.ff, bank.num_experts, top_k, bank.gate_type, bank.down_type)


@dataclass(frozen=True)
class Ceilings:
    device: str  # what the device figures were measured on
    link_gbps: float  # pinned host -> device copy (a host memory copy without an accelerator)
    zero_copy_gbps: float | None  # a device kernel reading pinned host memory; None: no kernel to measure it
    hbm_gbps: float  # device memory, bytes read + written by a large copy
    cpu_read_gbps: float  # host memory read (a large sum)
    cpu_expert_gbps: float  # CPU expert kernel, expert bytes per second, one token of top_k experts
    cpu_expert_path: str  # which kernel ran: "native-<simd>" or "torch"
    link_capped: bool = False  # the link figures are `--link-gbps`'s simulated link, not the machine's
    at_once_gbps: tuple[float, float] | None = None  # (link, CPU experts) reading host memory together; None: not run

    def capped(self, gbps: float | None) -> Ceilings:
        """The ceilings of a simulated slower link (`--link-gbps`), which bound the streamed misses."""
        if gbps is None:
            return self
        zero_copy = None if self.zero_copy_gbps is None else min(self.zero_copy_gbps, gbps)
        # NOTE: no at-once rates: they were measured with the machine's link reading host memory at full speed
        return replace(self, link_gbps=min(self.link_gbps, gbps), zero_copy_gbps=zero_copy, link_capped=True,
                       at_once_gbps=None)


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 5) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_copy_gbps(device: torch.device, num_bytes: int = DEVICE_BYTES) -> float:
    """A device-to-device copy: bytes read + written per second."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), lambda: torch.cuda.synchronize(device))
    return 2 * num_bytes / seconds / 1e9


def pinned_bank(shape: ExpertShape, num_bytes: int) -> ExpertWeights:
    """Zeroed experts of `shape` in pinned host memory, enough of them for `num_bytes` of gate rows (a
    gather copies bytes, so their values do not matter)."""
    gate_bytes = shape.ff * row_bytes(shape.gate_type, shape.hidden)
    n = max(shape.num_experts, -(-num_bytes // gate_bytes))

    def rows(num_rows: int, qtype: QType, cols: int) -> torch.Tensor:
        return torch.zeros((n, num_rows, row_bytes(qtype, cols)), dtype=torch.uint8, pin_memory=True)

    gate = rows(shape.ff, shape.gate_type, shape.hidden)  # also serves as up: only gate rows are read
    return ExpertWeights(gate, gate, rows(shape.hidden, shape.down_type, shape.ff), shape.gate_type,
                         shape.gate_type, shape.down_type, shape.hidden, shape.ff)


def zero_copy_gbps(device: torch.device, shape: ExpertShape) -> float | None:
    """The Triton gather reading every expert's gate rows from pinned host memory into device memory."""
    try:
        from ops.triton.experts import tables_from_bank
        from ops.triton.gather import launch_gather
    except ImportError:
        return None
    bank = pinned_bank(shape, HOST_BYTES)
    tables = tables_from_bank(bank, device)
    expert_ids = torch.arange(bank.num_experts, device=device)
    out = torch.empty((bank.num_experts, shape.ff * tables.gate_row_bytes), dtype=torch.uint8, device=device)
    seconds = _median_seconds(lambda: launch_gather(tables.gate_ptrs, expert_ids, 0, tables, out),
                              lambda: torch.cuda.synchronize(device))
    return out.numel() / seconds / 1e9


def cpu_expert_gbps(shape: ExpertShape, num_threads: int | None) -> tuple[float, str]:
    result = benchmark_cpu_experts(shape.hidden, shape.ff, shape.num_experts, shape.top_k, 1, shape.gate_type,
                                   shape.down_type, num_threads=num_threads)
    return result["gbps"], result["path"]


def measure_ceilings(device: torch.device, shape: ExpertShape, num_threads: int | None = None) -> Ceilings:
    host = memory_bandwidth_gbps(HOST_BYTES)  # {"read": GB/s, "copy": GB/s read + written}
    expert_gbps, path = cpu_expert_gbps(shape, num_threads)
    if device.type != "cuda":
        return Ceilings("host (no accelerator): device ceilings are the host's",
                        measure_link_gbps(device, HOST_BYTES), host["read"], host["copy"], host["read"],
                        expert_gbps, path)
    # NOTE: 0.5 s runs: the split's 0.1 s runs read the H100 host at 51.5 GB/s in all where 2 s runs of
    # .ci/gpu-host-share.py read 79-89 (2026-12-06)
    at_once = measure_shared_gbps(pinned_bank(shape, HOST_BYTES), pinned_bank(shape, HOST_BYTES), device, num_threads,
                                  seconds=0.5)
    return Ceilings(torch.cuda.get_device_name(device), measure_link_gbps(device, HOST_BYTES),
                    zero_copy_gbps(device, shape), device_copy_gbps(device), host["read"], expert_gbps, path,
                    at_once_gbps=at_once)
