"""The hybrid split: link / (link + CPU), the CPU's rate re-measured from its tasks' counters."""

from __future__ import annotations

import pytest
import torch

from engine.config import MissMode
from engine.expert_cache.cpu_tasks import CpuWork
from engine.expert_cache.split import Split
from ops.bank import random_expert_weights
from ops.quants import QType


@pytest.fixture(scope="module")
def bank():  # noqa: ANN201
    return random_expert_weights(8, 256, 256, QType.Q4_K)


def test_stream_and_cpu_modes_send_every_miss_one_way(bank) -> None:  # noqa: ANN001
    assert Split(MissMode("stream"), torch.device("cpu"), bank, False).share == 1.0
    assert Split(MissMode("cpu"), torch.device("cpu"), bank, False).share == 0.0


def test_hybrid_share_follows_the_measured_cpu_rate(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), bank, False, every=4)
    assert 0.0 < split.share < 1.0 and split.link_gbps > 0 and split.cpu_gbps > 0
    split.link_gbps = 10.0
    work = CpuWork()
    shares = []
    for _ in range(12):  # the CPU reads 30 GB/s: the device should stream 10 / (10 + 30) of the misses
        work = CpuWork(work.calls + 1, 0, 0, work.bytes + 30_000_000, work.busy_seconds + 0.001)
        shares.append(split.update(work))
    assert [s for s in shares if s is not None] == [pytest.approx(0.25)]
    assert split.cpu_gbps == pytest.approx(30.0)
