"""The CPU jobs' doorbell on CUDA (`ops.triton.bell`, `ops/csrc/bell.h`): a kernel rings once the job is
written, the native watcher runs the task, and the device waits for its answer before it reads the output;
the kernel that adds the output adds nothing for a layer that did not ring. (The watcher alone, on the CPU:
tests/ops/test_cpu_task.py; the ring against its torch reference: tests/ops/test_cache_step.py.)"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ops.bank import random_expert_weights
from ops.cache_step import Bell, CpuJob
from ops.cpu_experts import BellWatcher, ExpertTask, NativeExperts, QType

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HIDDEN, FF, NUM_EXPERTS, MAX_TOKENS, TOP_K = 512, 256, 16, 4, 8


def write_job(job: CpuJob, rng: np.random.Generator, num_tokens: int) -> None:
    pairs = num_tokens * TOP_K
    job.num_tokens[0] = num_tokens
    job.x[:num_tokens] = torch.from_numpy(rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32))
    job.expert_ids[:pairs] = torch.from_numpy(rng.integers(-1, NUM_EXPERTS, pairs).astype(np.int32))
    job.weights[:pairs] = torch.from_numpy(rng.uniform(0.1, 1.0, pairs).astype(np.float32))
    job.on_cpu[:pairs] = torch.from_numpy((rng.uniform(size=pairs) < 0.7).astype(np.int32))


def expected(lib: NativeExperts, job: CpuJob, w: object) -> torch.Tensor:
    n = int(job.num_tokens[0])
    ids, on = job.expert_ids[:n * TOP_K], job.on_cpu[:n * TOP_K]
    p = torch.nonzero((on != 0) & (ids >= 0)).reshape(-1)
    return lib.ffn(job.x[:n], p // TOP_K, ids[p].long(), job.weights[p], w)  # type: ignore[arg-type]


def test_the_device_rings_and_reads_the_output_only_after_the_answer(lib: NativeExperts) -> None:
    from ops.triton import hold
    from ops.triton.bell import ring_and_wait

    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=3)
    job = CpuJob.allocate(MAX_TOKENS, TOP_K, HIDDEN, pin=True, bell=Bell.allocate(CUDA))
    task = ExpertTask(w, job.x, job.expert_ids, job.weights, job.on_cpu, job.num_tokens, job.out, lib=lib)
    watcher = BellWatcher(job.bell.words, [None, task, task], spin_us=2000, lib=lib)  # type: ignore[union-attr]
    rng, seen = np.random.default_rng(4), torch.empty((MAX_TOKENS, HIDDEN), device=CUDA)
    try:
        for r in range(1, 31):
            num_tokens = 1 + r % MAX_TOKENS
            write_job(job, rng, num_tokens)
            job.out.fill_(float("nan"))
            hold(50_000, CUDA)  # the ring comes while the host is already waiting
            ring_and_wait(job.bell, 1 + r % 2)  # type: ignore[arg-type]  (task 1: an int Triton would specialize)
            seen.copy_(job.out, non_blocking=True)  # the device's read of the output, after the wait
            torch.cuda.synchronize()
            assert torch.equal(seen[:num_tokens].cpu(), expected(lib, job, w)), f"ring {r}: read before the answer"
            assert int(job.bell.words[Bell.DONE]) == r == int(job.bell.state[0].item())  # type: ignore[union-attr]
        assert watcher.answered == 30 and task.counters.calls == 30
    finally:
        watcher.close()


def test_the_combine_waits_for_the_answer_and_adds_nothing_without_a_ring() -> None:
    from ops.triton.combine import launch_combine

    bell = Bell.allocate(CUDA)
    extra = torch.full((2, 64), 5.0, pin_memory=True)
    y = torch.ones((4, 64), device=CUDA)
    token_ids = torch.tensor([0, 1, 0, 1], device=CUDA)
    out = torch.empty((2, 64), device=CUDA)
    bell.state.copy_(torch.tensor([7, 0]))  # the layer did not ring: extra holds an older layer's rows
    launch_combine(y, token_ids, out, extra=extra, bell=bell)
    assert bool((out == 2.0).all())
    bell.words[Bell.DONE] = 7
    bell.state.copy_(torch.tensor([8, 1]))  # rang as number 8: answered later, with new rows

    def answer() -> None:
        time.sleep(0.05)
        extra.fill_(3.0)
        bell.words[Bell.DONE] = 8

    helper = threading.Thread(target=answer)
    torch.cuda.synchronize()
    helper.start()
    launch_combine(y, token_ids, out, extra=extra, bell=bell)
    torch.cuda.synchronize()
    helper.join()
    assert bool((out == 5.0).all()), "the combine read the CPU's rows before the answer"
