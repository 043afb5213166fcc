"""`--link-gbps`: a slower host link simulated on a fast one, for benchmarks of desktop-class links. What
each copy waits, where the option is refused, and the ceilings bench prints for it (the waits themselves
are timed on the GPU: tests/ops/test_triton_stage.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.expert_cache.cache import link_cap
from engine.expert_cache.device import LinkCap
from service.bench.ceilings import Ceilings


def test_a_copy_waits_what_the_slower_link_adds() -> None:
    cap = LinkCap(gbps=16.0, measured_gbps=48.0)
    assert cap.extra_ns(48_000_000) == 3_000_000 - 1_000_000  # 48 MB: 3 ms at 16 GB/s, 1 ms already spent
    assert cap.extra_ns(0) == 0


def test_a_cap_above_the_machine_link_adds_nothing() -> None:
    assert LinkCap(gbps=64.0, measured_gbps=48.0).extra_ns(1 << 30) == 0


@pytest.mark.parametrize("gbps", [0.0, -1.0, float("nan")])
def test_the_rate_must_be_positive(gbps: float) -> None:
    with pytest.raises(ValueError, match="--link-gbps must be > 0"):
        CacheConfig(link_gbps=gbps)


def test_the_cpu_has_no_link_to_cap() -> None:
    assert link_cap(CacheConfig(), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        link_cap(CacheConfig(link_gbps=16.0), torch.device("cpu"))


def test_bench_ceilings_take_the_capped_link() -> None:
    measured = Ceilings("H200", 54.0, 48.0, 4000.0, 100.0, 70.0, "native-avx512-vnni")
    capped = measured.capped(16.0)
    assert (capped.link_gbps, capped.zero_copy_gbps, capped.link_capped) == (16.0, 16.0, True)
    assert measured.capped(None) is measured
    assert measured.capped(100.0).link_gbps == 54.0  # a cap above the machine's link changes nothing
