"""The hybrid split: link / (link + CPU) and the lead of the CPU task's fixed cost, the CPU's rate re-measured
from its tasks' counters, and when hybrid uploads what the CPU computed."""

from __future__ import annotations

import pytest
import torch

from engine.config import MissMode
from engine.expert_cache.cpu_tasks import CpuWork
from engine.expert_cache.split import LinkLoad, Split
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
    assert [s for s in shares if s is not None] == [(pytest.approx(0.25), 0.0)]  # no fixed cost on the CPU
    assert split.cpu_gbps == pytest.approx(30.0)


def test_the_lead_is_the_fixed_cost_in_experts_of_both_paths(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), bank, False)
    split.link_gbps, split.cpu_gbps, split.fixed_seconds = 50.0, 75.0, 30e-6
    split.expert_bytes = 3_000_000  # 60 us streamed, 40 us on the CPU: 30 us is 0.3 of both
    share, lead = split._split()
    assert (share, lead) == (pytest.approx(0.4), pytest.approx(0.3))
    # 2 misses: 0.8 + 0.3 -> 1 streamed (60 us) and 1 on the CPU (30 + 40 us): the times the split equalizes
    assert int(share * 2 + lead + 0.5) == 1


def test_hybrid_uploads_the_cpus_misses_only_while_the_link_is_mostly_idle(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), bank, False)
    split.link = LinkLoad(50.0, steps=4)
    assert split.uploads_cpu_misses  # nothing streamed yet
    for _ in range(20):  # 42 MB a 5 ms step at 50 GB/s: the link busy 17% of the time
        split.link.add(42_000_000, 0.005)
    assert split.link.busy == pytest.approx(0.168) and split.uploads_cpu_misses
    for _ in range(20):  # 140 MB a 8 ms step: 35%
        split.link.add(140_000_000, 0.008)
    assert split.link.busy == pytest.approx(0.35, abs=0.01) and not split.uploads_cpu_misses
    stream = Split(MissMode("stream"), torch.device("cpu"), bank, False)
    assert not stream.uploads_cpu_misses  # a streamed miss lands: nothing the CPU computed to upload
