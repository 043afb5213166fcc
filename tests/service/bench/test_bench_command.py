"""`moecache bench` end to end on a tiny model: a short sweep (2 budgets x 2 policies x 2 miss modes) with
synthetic routing. A smoke test of the command and of its accounting, not a timing test."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from service.cli import main

BUDGETS, POLICIES, MISS_MODES, BATCHES = (0.0, 0.5), ("lru", "decay"), ("cpu", "stream"), (1, 2)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class BenchRun:
    stdout: str
    doc: dict[str, Any]
    plot: Path


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> BenchRun:
    tmp = tmp_path_factory.mktemp("bench")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "-m", str(tiny_model), "--device", "cpu", "--cpu-moe",
                     "--budget-frac", "0,0.5", "--policy", "lru,decay", "--miss-mode", "cpu,stream",
                     "--gen-len", "4", "--prompt-len", "32", "--repeats", "1", "--batches", "1,2",
                     "--routing", "synthetic:qwen3",
                     "--json", str(tmp / "bench.json"), "--plot", str(tmp / "bench.png")])
    assert code == 0
    return BenchRun(out.getvalue(), json.loads((tmp / "bench.json").read_text()), tmp / "bench.png")


def configs(run: BenchRun) -> list[dict[str, Any]]:
    return run.doc["configurations"]


def test_every_configuration_has_finite_positive_speeds(bench: BenchRun) -> None:
    seen = {(c["config"]["budget_frac"], c["config"]["policy"], c["config"]["miss_mode"])
            for c in configs(bench)}
    assert len(configs(bench)) == 8 and seen == set(itertools.product(BUDGETS, POLICIES, MISS_MODES))
    for c in configs(bench):
        assert [d["batch"] for d in c["decode"]] == list(BATCHES)
        rates = [d["tokens_per_second"] for d in c["decode"]] + [c["prefill"]["tokens_per_second"]]
        assert all(math.isfinite(r) and r > 0 for r in rates)
        assert 0 < c["prefill"]["ttft_seconds"] < math.inf


def test_hit_ratios_are_ratios_and_a_zero_budget_caches_nothing(bench: BenchRun) -> None:
    for c in configs(bench):
        assert all(0.0 <= d["hit_ratio"] <= 1.0 for d in c["decode"])
        if c["config"]["budget_frac"] == 0.0:
            assert c["num_slots"] == 0 and c["totals"]["hits"] == 0 and c["totals"]["uploaded_bytes"] == 0
            assert all(d["hit_ratio"] == 0.0 and d["uploaded_bytes_per_token"] == 0.0 for d in c["decode"])
        else:  # half the experts have a slot, so decode finds some of them cached
            assert c["cached_share"] >= 0.5 and c["totals"]["hits"] > 0 and c["totals"]["promotions"] > 0
            # NOTE: one crossing per miss: streamed misses land in the cache, only the CPU's are uploaded
            assert (c["totals"]["uploaded_bytes"] > 0) == (c["config"]["miss_mode"] == "cpu")


def test_misses_go_where_the_miss_mode_sends_them(bench: BenchRun) -> None:
    for c in configs(bench):
        if c["config"]["budget_frac"] != 0.0:
            continue
        single = c["decode"][0]
        if c["config"]["miss_mode"] == "cpu":
            assert single["cpu_experts_per_token"] > 0 and single["streamed_bytes_per_token"] == 0
        else:
            assert single["cpu_experts_per_token"] == 0 and single["streamed_bytes_per_token"] > 0


def test_per_token_bytes_add_up_to_the_cache_totals(bench: BenchRun) -> None:
    for c in configs(bench):
        phases, totals = c["phases"], c["totals"]
        assert {p["run"] for p in phases} == {0, 1}  # the warm-up and one measured run
        for name in ("uploaded_bytes", "streamed_bytes", "cpu_experts"):
            summed = sum(p[f"{name}_per_token"] * p["tokens"] for p in phases)
            assert summed == pytest.approx(totals[name], rel=1e-9, abs=1e-6)
        picks = sum(p["cache"]["hits"] + p["cache"]["misses"] for p in phases)
        assert picks == totals["hits"] + totals["misses"] > 0


def test_decode_figures_are_the_medians_of_the_measured_runs(bench: BenchRun) -> None:
    for c in configs(bench):
        for d in c["decode"]:
            measured = [p for p in c["phases"]
                        if p["kind"] == "decode" and p["batch"] == d["batch"] and p["run"] > 0]
            assert len(measured) == 1 and measured[0]["tokens"] == d["batch"] * 3  # gen-len 4: 3 decode steps
            assert d["tokens_per_second"] == measured[0]["tokens_per_second"]
            assert d["uploaded_bytes_per_token"] == measured[0]["uploaded_bytes_per_token"]


def test_the_bound_is_beside_the_batch_one_figure(bench: BenchRun) -> None:
    ceilings = bench.doc["ceilings"]
    assert "host" in ceilings["device"] and ceilings["zero_copy_gbps"] == ceilings["cpu_read_gbps"]
    assert all(ceilings[k] > 0 for k in ("link_gbps", "hbm_gbps", "cpu_read_gbps", "cpu_expert_gbps"))
    for c in configs(bench):
        b, speed = c["bound"], c["decode"][0]["tokens_per_second"]
        assert b["seconds"] == max(b["gpu_floor_seconds"], b["miss_seconds"]) > 0
        assert b["share_of_bound"] == pytest.approx(b["seconds"] * speed)
        assert b["host_seconds"] is None and b["share_of_host_bound"] is None  # no device: no at-once rates
        missed = 1 - c["decode"][0]["hit_ratio"]
        assert b["miss_bytes"] == pytest.approx(missed * c["token_bytes"]["host_experts"])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in bench.stdout.splitlines()
            if line.startswith("|")]
    assert rows[0][-3:] == ["bound ms/tok", "of bound", "of host"] and len(rows) == 2 + 8 * len(BATCHES)
    for row in rows[2:]:  # the bound and its share on each batch-1 row only
        assert row[5] in ("1", "2") and row[-2].endswith("%") == (row[5] == "1") and row[-1] == ""


def test_the_plot_is_a_png_with_two_panels_worth_of_pixels(bench: BenchRun) -> None:
    assert bench.plot.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = matplotlib.image.imread(bench.plot).shape
    assert width > 2 * height > 400


def test_replaced_routing_is_announced(bench: BenchRun) -> None:
    notice = "routing: synthetic:qwen3 (router's choice replaced)"
    assert bench.stdout.startswith(notice)
    assert bench.stdout.count(notice) == 2  # announced at the start and in the table's header
    assert bench.doc["routing"] == {"spec": "synthetic:qwen3", "replaced": True, "notice": notice}
