"""The native worker pool under the CPU expert kernel: results independent of the thread count, many
layers in a row, concurrent callers, idle workers asleep."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ops.bank import ExpertWeights, random_expert_weights
from ops.cpu_experts import NativeExperts, QType
from tests.ops.test_cpu_experts import FORMATS

HIDDEN, FF, NUM_EXPERTS = 512, 256, 6
MAX_THREADS = max(4, (os.cpu_count() or 1) + 1)  # more threads than cores: the busy-host case


Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ExpertWeights]


def layer(seed: int, num_tokens: int = 9, num_pairs: int = 40, types: tuple[QType, ...] = FORMATS[4]) -> Layer:
    rng = np.random.default_rng(seed)
    w = random_expert_weights(NUM_EXPERTS, HIDDEN, FF, *types, seed=seed)
    x = torch.from_numpy(rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32))
    tokens = torch.from_numpy(rng.integers(0, num_tokens, num_pairs))
    experts = torch.from_numpy(rng.integers(0, NUM_EXPERTS, num_pairs))
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, num_pairs).astype(np.float32))
    return x, tokens, experts, weights, w


@pytest.mark.parametrize("types", FORMATS, ids=lambda t: "-".join(q.name for q in t))
def test_every_thread_count_gives_the_same_bits(lib: NativeExperts, types: tuple[QType, QType, QType]) -> None:
    args = layer(seed=1, types=types)
    outs = [lib.ffn(*args, num_threads=n) for n in range(1, MAX_THREADS + 1)]
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_many_layers_in_a_row(lib: NativeExperts) -> None:
    """Layers of every size back to back, each equal to its own one-thread result: no state leaks."""
    layers = [layer(seed=s, num_tokens=1 + s % 5, num_pairs=s % 9) for s in range(12)]
    expected = [lib.ffn(*args, num_threads=1) for args in layers]
    for i in range(240):
        assert torch.equal(lib.ffn(*layers[i % 12], num_threads=1 + i % MAX_THREADS), expected[i % 12])


def test_a_layer_without_pairs_writes_zeros(lib: NativeExperts) -> None:
    x, tokens, experts, weights, w = layer(seed=2, num_pairs=0)
    assert torch.count_nonzero(lib.ffn(x, tokens, experts, weights, w, num_threads=MAX_THREADS)) == 0


def test_concurrent_callers_do_not_mix(lib: NativeExperts) -> None:
    layers = [layer(seed=10 + s) for s in range(4)]
    expected = [lib.ffn(*args, num_threads=1) for args in layers]
    wrong: list[int] = []

    def caller(k: int) -> None:
        for i in range(25):
            if not torch.equal(lib.ffn(*layers[k], num_threads=1 + (i + k) % MAX_THREADS), expected[k]):
                wrong.append(k)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def worker_states() -> list[str]:
    """Scheduler state (R running, S sleeping, ...) of this process's pool workers."""
    states = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "moecache-cpu":
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return states


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_idle_workers_sleep_and_wake_for_the_next_layer(lib: NativeExperts) -> None:
    assert lib.start_pool(3, spin_us=1000) >= 3
    args = layer(seed=3)
    expected = lib.ffn(*args, num_threads=1)
    assert torch.equal(lib.ffn(*args, num_threads=3), expected)
    time.sleep(0.2)  # far past the 1 ms spin
    states = worker_states()
    assert len(states) >= lib.pool_threads - 1 >= 2
    assert set(states) == {"S"}
    assert torch.equal(lib.ffn(*args, num_threads=3), expected)  # woken from sleep
    lib.start_pool(spin_us=200)


def test_pool_grows_to_the_thread_count_asked(lib: NativeExperts) -> None:
    lib.ffn(*layer(seed=4), num_threads=MAX_THREADS + 1)
    assert lib.pool_threads >= MAX_THREADS + 1
    assert lib.reserve_threads(MAX_THREADS + 2) == lib.pool_threads >= MAX_THREADS + 2
