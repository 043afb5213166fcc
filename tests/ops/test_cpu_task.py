"""The native task a decode step's device rings for: bit-identical to the kernel on the flagged pairs, as close to
the float reference, counters, bad input, calls from threads no Python knows of, and the watcher that answers
the device's rings (the device's side played here by the test: the GPU test is in tests/ops/test_bell.py)."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ops import native
from ops.bank import ExpertWeights, random_expert_weights
from ops.cache_step import TASK_BITS, Bell
from ops.cpu_experts import BellWatcher, ExpertTask, NativeExperts, QType
from ops.expert_ffn import expert_ffn_reference
from tests.ops.test_cpu_experts import FORMATS, MATHS, assert_close, with_math

HIDDEN, FF, NUM_EXPERTS, MAX_TOKENS, TOP_K = 512, 256, 6, 7, 4
HOST_THREADS = Path(__file__).resolve().parent / "csrc" / "host_threads.c"


class Step:
    """A task's host buffers, as the captured step would hold them, and the task over them."""

    def __init__(self, lib: NativeExperts, w: ExpertWeights, seed: int, num_tokens: int,
                 num_threads: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.w = w
        self.x = torch.from_numpy(rng.standard_normal((MAX_TOKENS, HIDDEN), dtype=np.float32))
        self.expert_ids = torch.from_numpy(rng.integers(-1, NUM_EXPERTS, (MAX_TOKENS, TOP_K)).astype(np.int32))
        self.weights = torch.from_numpy(rng.uniform(0.05, 1.0, (MAX_TOKENS, TOP_K)).astype(np.float32))
        self.on_cpu = torch.from_numpy((rng.uniform(size=(MAX_TOKENS, TOP_K)) < 0.6).astype(np.int32))
        self.num_tokens = torch.tensor([num_tokens], dtype=torch.int32)
        self.out = torch.full((MAX_TOKENS, HIDDEN), float("nan"))
        self.task = ExpertTask(w, self.x, self.expert_ids, self.weights, self.on_cpu, self.num_tokens, self.out,
                               num_threads=num_threads, lib=lib)

    def flagged(self) -> torch.Tensor:
        n = int(self.num_tokens)
        ids, on = self.expert_ids[:n].reshape(-1), self.on_cpu[:n].reshape(-1)
        return torch.nonzero((on != 0) & (ids >= 0)).reshape(-1)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids, expert_ids, weights of the flagged pairs."""
        p = self.flagged()
        tokens = torch.div(p, TOP_K, rounding_mode="floor")
        return tokens, self.expert_ids.reshape(-1)[p].long(), self.weights.reshape(-1)[p]

    def expected(self, lib: NativeExperts) -> torch.Tensor:
        """moe_expert_ffn on the flagged pairs of rows < num_tokens."""
        return lib.ffn(self.x[: int(self.num_tokens)], *self.pairs(), self.w)

    def reference(self) -> torch.Tensor:
        """The float reference on the flagged pairs of rows < num_tokens."""
        return expert_ffn_reference(self.x[: int(self.num_tokens)], *self.pairs(), self.w)


@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_task_equals_the_kernel_on_the_flagged_pairs(lib: NativeExperts, types: tuple[QType, QType, QType]) -> None:
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=1)
    for seed, num_tokens in ((2, 5), (3, MAX_TOKENS), (4, 1), (5, 0)):
        step = Step(lib, w, seed, num_tokens)
        step.task.run()
        assert torch.equal(step.out[:num_tokens], step.expected(lib))
        assert bool(step.out[num_tokens:].isnan().all())  # rows past num_tokens are not the task's


@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_task_matches_the_float_reference(lib: NativeExperts, types: tuple[QType, QType, QType]) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=31), seed=32, num_tokens=MAX_TOKENS)
    step.task.run()
    assert len(step.flagged()) > MAX_TOKENS
    assert_close(step.out, step.reference(), types)


@pytest.mark.parametrize("math", list(MATHS))
def test_task_computes_the_banks_math(lib: NativeExperts, math: str) -> None:
    types = (QType.MXFP4, QType.MXFP4, QType.MXFP4)
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=41), math, seed=42)
    step = Step(lib, w, seed=43, num_tokens=MAX_TOKENS)
    step.task.run()
    assert torch.equal(step.out, step.expected(lib))
    assert_close(step.out, step.reference(), types)


def test_task_keeps_its_float32_biases(lib: NativeExperts) -> None:
    """float64 biases: the task's float32 copies are the only ones, and must outlive the call that made them."""
    w = with_math(random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.MXFP4, seed=44), "swiglu_oai-biases", seed=45)
    m = w.math
    wide = replace(w, math=replace(m, gate_bias=m.gate_bias.double(), up_bias=m.up_bias.double(),  # type: ignore[union-attr]
                                   down_bias=m.down_bias.double()))  # type: ignore[union-attr]
    step = Step(lib, wide, seed=46, num_tokens=MAX_TOKENS)
    gc.collect()
    torch.randn(64, HIDDEN, FF)  # reuses freed memory, if any was freed
    step.task.run()
    assert torch.equal(step.out, Step(lib, w, seed=46, num_tokens=MAX_TOKENS).expected(lib))


def test_a_token_without_cpu_pairs_gets_a_zero_row(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=6), seed=7, num_tokens=4)
    step.on_cpu[2] = 0
    step.task.run()
    assert torch.count_nonzero(step.out[2]) == 0 and torch.equal(step.out[:4], step.expected(lib))


def test_task_reads_its_inputs_when_it_runs(lib: NativeExperts) -> None:
    """One task over fixed buffers, rewritten before each run the way a graph's copies rewrite them."""
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, QType.Q4_K, QType.Q6_K, seed=8)
    step = Step(lib, w, seed=9, num_tokens=3)
    for seed in range(10, 16):
        fresh = Step(lib, w, seed, num_tokens=1 + seed % MAX_TOKENS)
        for name in ("x", "expert_ids", "weights", "on_cpu", "num_tokens"):
            getattr(step, name).copy_(getattr(fresh, name))
        step.task.run()
        n = int(step.num_tokens)
        assert torch.equal(step.out[:n], fresh.expected(lib))


def test_thread_count_does_not_change_the_task(lib: NativeExperts) -> None:
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q5_K, QType.Q5_K, QType.Q8_0, seed=17)
    outs = []
    for threads in (1, 2, 3, 5):
        step = Step(lib, w, seed=18, num_tokens=6, num_threads=threads)
        step.task.run()
        outs.append(step.out[:6])
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_counters_accumulate_over_runs(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q6_K, seed=19), seed=20, num_tokens=5)
    for _ in range(3):
        step.task.run()
    pairs = step.flagged()
    experts = len(set(step.expert_ids.reshape(-1)[pairs].tolist()))
    c = step.task.counters
    assert (c.calls, c.pairs, c.experts, c.error) == (3, 3 * len(pairs), 3 * experts, 0)
    assert c.bytes == 3 * experts * step.w.expert_bytes
    assert c.busy_ns > 0


def test_a_bad_expert_id_sets_the_error_and_writes_zeros(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=21), seed=22, num_tokens=5)
    step.expert_ids[1, 2], step.on_cpu[1, 2] = NUM_EXPERTS, 1
    with pytest.raises(ValueError, match="expert id"):
        step.task.run()
    assert step.task.counters.error == -4
    assert torch.count_nonzero(step.out[:5]) == 0 and bool(step.out[5:].isnan().all())
    step.on_cpu[1, 2] = 0  # an unflagged pair's id is never read
    step.task.run()
    assert step.task.counters.error == 0 and torch.equal(step.out[:5], step.expected(lib))


def test_num_tokens_past_the_buffers_is_an_error(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q8_0, seed=23), seed=24, num_tokens=3)
    step.num_tokens.fill_(MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="bad shape"):
        step.task.run()
    assert step.task.counters.error == -2 and torch.count_nonzero(step.out) == 0


def test_task_checks_its_tensors(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=25), seed=26, num_tokens=2)
    with pytest.raises(ValueError, match="expert_ids"):
        ExpertTask(step.w, step.x, step.expert_ids.long(), step.weights, step.on_cpu, step.num_tokens, step.out)
    with pytest.raises(ValueError, match="out"):
        ExpertTask(step.w, step.x, step.expert_ids, step.weights, step.on_cpu, step.num_tokens, step.out[:, :8])


def host_threads() -> ctypes.CDLL:
    helper = native.load_library(HOST_THREADS)
    if helper is None:
        pytest.skip("no C compiler")
    helper.run_on_host_threads.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                           ctypes.c_int]
    return helper


def run_on_host_threads(tasks: list[ExpertTask], times: int) -> None:
    """Each task run `times` times on a native thread of its own, all at once, as watcher threads would."""
    args = (ctypes.c_void_p * len(tasks))(*(t.address for t in tasks))
    assert host_threads().run_on_host_threads(tasks[0].function_address, args, len(tasks), times) == 0


def test_task_runs_on_a_thread_python_does_not_know(lib: NativeExperts) -> None:
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, seed=27), seed=28, num_tokens=6)
    run_on_host_threads([step.task], times=3)
    assert step.task.counters.calls == 3 and torch.equal(step.out[:6], step.expected(lib))


def test_host_threads_and_python_callers_at_once(lib: NativeExperts) -> None:
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, QType.Q4_K, QType.Q6_K, seed=29)
    steps = [Step(lib, w, seed=30 + k, num_tokens=2 + k, num_threads=1 + k) for k in range(3)]
    x, tokens, experts, weights = steps[0].x[:4], torch.arange(4).repeat(2), torch.arange(8) % NUM_EXPERTS, \
        torch.rand(8)
    expected = lib.ffn(x, tokens, experts, weights, w)
    wrong: list[bool] = []

    def python_caller() -> None:
        wrong.extend(not torch.equal(lib.ffn(x, tokens, experts, weights, w, num_threads=2), expected)
                     for _ in range(30))

    caller = threading.Thread(target=python_caller)
    caller.start()
    run_on_host_threads([s.task for s in steps], times=20)
    caller.join()
    assert not any(wrong)
    for s in steps:
        assert s.task.counters.calls == 20 and torch.equal(s.out[: int(s.num_tokens)], s.expected(lib))


def wait_for(words: torch.Tensor, seq: int, timeout: float = 10.0) -> bool:
    """Poll the answer word as the device does; False after `timeout` seconds."""
    end = time.monotonic() + timeout
    while int(words[Bell.DONE]) < seq:
        if time.monotonic() > end:
            return False
        time.sleep(1e-4)
    return True


def test_the_watcher_runs_the_task_rung_for_and_answers_after_its_output(lib: NativeExperts) -> None:
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q4_K, QType.Q4_K, QType.Q6_K, seed=41)
    steps = [Step(lib, w, seed=42 + k, num_tokens=3 + k) for k in range(2)]
    words = Bell.allocate(torch.device("cpu")).words
    watcher = BellWatcher(words, [steps[0].task, None, steps[1].task], spin_us=500, lib=lib)
    try:
        for seq, task in enumerate((2, 0, 2, 1, 7), start=1):  # 1: no task there, 7: past the table
            for s in steps:
                s.out.fill_(float("nan"))
            words[Bell.RING] = seq << TASK_BITS | task
            assert wait_for(words, seq), f"ring {seq} (task {task}) not answered"
            ran = {0: steps[0], 2: steps[1]}.get(task)
            for s in steps:
                n = int(s.num_tokens)
                if s is ran:
                    assert torch.equal(s.out[:n], s.expected(lib)), f"ring {seq}: the output is not the task's"
                else:
                    assert bool(s.out.isnan().all()), f"ring {seq}: a task that was not rung for ran"
            assert watcher.answered == seq and int(words[Bell.DONE]) == seq
        assert steps[0].task.counters.calls == 1 and steps[1].task.counters.calls == 2
    finally:
        watcher.close()
    words[Bell.RING] = 6 << TASK_BITS
    time.sleep(0.05)
    assert int(words[Bell.DONE]) == 5 and watcher.answered == 0  # stopped: nothing answers


def test_the_watcher_answers_after_an_idle_spell(lib: NativeExperts) -> None:
    """Past its spin the watcher polls with sleeps: a ring after a quiet spell is still answered."""
    step = Step(lib, random_expert_weights(NUM_EXPERTS, HIDDEN, FF, QType.Q8_0, seed=45), seed=46, num_tokens=2)
    words = Bell.allocate(torch.device("cpu")).words
    watcher = BellWatcher(words, [step.task], spin_us=100, lib=lib)
    try:
        time.sleep(0.05)
        words[Bell.RING] = 1 << TASK_BITS
        assert wait_for(words, 1) and torch.equal(step.out[:2], step.expected(lib))
    finally:
        watcher.close()
