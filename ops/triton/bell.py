"""The device's side of the CPU jobs' doorbell (`ops.cache_step.Bell`, `ops/csrc/bell.h`): `ring_bell` in
the kernel that writes a layer's job, `wait_bell` in the kernel that adds the job's output.

The ring is a store to pinned host memory after a system-scope fence, so the CPU sees the job before the
ring; the wait polls the answer with volatile loads, which read host memory each time, and the output is
then read with `.cv` loads (never a stale cached line). A wait that gets no answer in `WAIT_LIMIT_NS`
traps, failing the step with a CUDA error rather than hanging the device.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.cache_step import TASK_BITS, Bell

WAIT_LIMIT_NS = tl.constexpr(10_000_000_000)
_TASK_BITS = tl.constexpr(TASK_BITS)
_RING, _DONE = tl.constexpr(Bell.RING), tl.constexpr(Bell.DONE)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def ring_bell(words, state, task, rang):
    """One program, after its job writes: state[1] := rang; when rang, the next sequence number in state[0]
    and the ring word seq << TASK_BITS | task in words[RING], behind a system-scope fence."""
    seq = tl.load(state) + 1
    tl.debug_barrier()  # every thread has read state[0] and issued its job writes
    tl.store(state + 1, rang.to(tl.int64))
    if rang:
        tl.store(state, seq)
        tl.inline_asm_elementwise("fence.sc.sys;\n\tst.volatile.global.u64 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,l",
                                  [words + _RING, (seq << _TASK_BITS) | task], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # state is written for the program's other threads


@triton.jit
def wait_bell(words, state):
    """Whether the current layer rang (1 or 0); when it did, returns once words[DONE] >= its number."""
    rang = tl.load(state + 1)
    if rang != 0:
        seq = tl.load(state)
        start = _now_ns()
        done = tl.load(words + _DONE, volatile=True)
        while done < seq:
            if _now_ns() - start > WAIT_LIMIT_NS:
                tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            done = tl.load(words + _DONE, volatile=True)
    return rang


@triton.jit(do_not_specialize=["task"])  # NOTE: Triton makes an int argument of 1 a constant: `task >= 0` a bool
def _ring_and_wait_kernel(words, state, task):
    ring_bell(words, state, task, task >= 0)
    wait_bell(words, state)


def ring_and_wait(bell: Bell, task: int) -> None:
    """Ring for `task` and wait for the answer, on the current stream (a job written beforehand; timing)."""
    if bell.words.device.type != "cpu" or bell.state.device.type != "cuda":
        raise ValueError("ring_and_wait: a bell of pinned host words and a device state")
    with torch.cuda.device(bell.state.device):
        _ring_and_wait_kernel[(1,)](bell.words, bell.state, task, num_warps=1)
