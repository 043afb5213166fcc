"""What the pieces of a captured decode step cost on this machine (CUDA): a Triton launch that does
nothing, by grid size; a host node (cuLaunchHostFunc) on the compute stream and on a forked side
stream; and a round trip through pinned memory (kernel writes, host node reads and writes, kernel reads).
Each figure is the replay time of a graph of 48 repetitions (one per layer of Qwen3-30B-A3B), per piece.
Usage: python3 .ci/gpu-graph-costs.py
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

LAYERS = 48
RELAY_C = r"""
#include <stdint.h>
#include <time.h>
/* host node: b[0] = a[0] + 1 (a written by a kernel, b read by the next kernel) */
void relay(void *arg) { int32_t *p = arg; p[1] = p[0] + 1; }
/* host node: busy for p[0] microseconds (a CPU task of that length) */
void busy(void *arg) {
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    long us = *(int32_t *)arg;
    do { clock_gettime(CLOCK_MONOTONIC, &b); }
    while ((b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 < us);
}
"""


@triton.jit
def _nothing(x, n):
    if tl.program_id(0) < 0:
        tl.store(x, n)


@triton.jit
def _bump(src, dst):
    tl.store(dst, tl.load(src) + 1)


def host_functions() -> ctypes.CDLL:
    folder = tempfile.mkdtemp()
    src, lib = os.path.join(folder, "relay.c"), os.path.join(folder, "relay.so")
    with open(src, "w") as f:
        f.write(RELAY_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    return ctypes.CDLL(lib)


CUDA = ctypes.CDLL("libcuda.so.1")
CUDA.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


def host_node(fn: ctypes._CFuncPtr, arg: int, stream: torch.cuda.Stream) -> None:
    rc = CUDA.cuLaunchHostFunc(stream.cuda_stream, ctypes.cast(fn, ctypes.c_void_p), arg)
    if rc:
        raise RuntimeError(f"cuLaunchHostFunc: CUresult {rc}")


def replay_us(body: Callable[[], None], repeats: int = 50) -> float:
    """Microseconds per repetition of `body` inside a graph of LAYERS repetitions (replayed
    `repeats + 1` times after one eager run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            body()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] / LAYERS * 1e6


def main() -> None:
    lib = host_functions()
    x = torch.zeros(16, dtype=torch.int32, device="cuda")
    for grid in (1, 8, 128, 1024, 5184):
        us = replay_us(lambda g=grid: _nothing[(g,)](x, 1))
        print(f"empty Triton launch, grid {grid:5d}: {us:6.2f} us")
    fork = torch.cuda.Stream()
    pinned = torch.zeros(4, dtype=torch.int32).pin_memory()
    addr = pinned.data_ptr()

    def kernel_host_kernel() -> None:  # on the compute stream
        _bump[(1,)](x, pinned)  # pinned[0] = x[0] + 1
        host_node(lib.relay, addr, torch.cuda.current_stream())  # pinned[1] = pinned[0] + 1
        _bump[(1,)](pinned[1:], x)  # x[0] = pinned[1] + 1

    x.zero_()
    us = replay_us(kernel_host_kernel)
    print(f"kernel -> host node -> kernel through pinned memory: {us:6.2f} us; x advanced by 3 per piece: "
          f"{int(x[0]) == 3 * (1 + LAYERS * 51)}")
    base = replay_us(lambda: (_bump[(1,)](x, pinned), _bump[(1,)](pinned, x)))
    print(f"the same without the host node: {base:6.2f} us")

    def forked(work_us: int) -> Callable[[], None]:
        arg = torch.tensor([work_us], dtype=torch.int32).pin_memory()

        def body() -> None:
            main_stream = torch.cuda.current_stream()
            fork.wait_stream(main_stream)
            with torch.cuda.stream(fork):
                host_node(lib.busy, arg.data_ptr(), fork)
            for _ in range(4):  # the device's own work meanwhile
                _nothing[(8,)](x, 1)
            main_stream.wait_stream(fork)
        body.arg = arg  # type: ignore[attr-defined]
        return body

    for work in (0, 50, 200):
        print(f"host node of {work:3d} us on a forked stream beside 4 launches: {replay_us(forked(work)):7.2f} us")
    print(f"4 launches alone: {replay_us(lambda: [_nothing[(8,)](x, 1) for _ in range(4)]):7.2f} us")


if __name__ == "__main__":
    main()
