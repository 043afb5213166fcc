"""The CPU expert benchmark reports its figures."""

from __future__ import annotations

import pytest

from ops.cpu_experts import QType, load_native
from tools.bench_cpu import benchmark_cpu_experts


def test_benchmark_reports_throughput() -> None:
    if load_native() is None:
        pytest.skip("no C compiler")
    r = benchmark_cpu_experts(hidden=256, ff=256, num_experts=8, top_k=2, num_tokens=3, repeats=3)
    assert r["num_pairs"] == 6
    assert str(r["path"]).startswith("native-")
    assert float(r["seconds"]) > 0 and float(r["gbps"]) > 0 and float(r["gflops"]) > 0


def test_benchmark_runs_mxfp4_with_the_gpt_oss_math() -> None:
    if load_native() is None:
        pytest.skip("no C compiler")
    r = benchmark_cpu_experts(hidden=256, ff=256, num_experts=8, top_k=2, qtype=QType.MXFP4, repeats=3,
                              activation="swiglu_oai", biases=True)
    assert str(r["path"]).startswith("native-") and float(r["gbps"]) > 0
