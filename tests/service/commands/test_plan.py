"""`moecache plan` on a model with the real Qwen3-30B-A3B shapes (a sparse GGUF: headers, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli import main
from tools.embedded_vocab import build_embedded_vocab
from tools.routing import synthetic_trace
from tools.synth import PRESETS, write_synth

MiB = 1 << 20


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "qwen3-30b-a3b.gguf"
    write_synth(path, PRESETS["qwen3moe-30b-a3b"], build_embedded_vocab(), sparse=True)
    return path


def plan_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mib", [21, 100, 2000, 15552, 40000])
def test_slots_never_exceed_the_budget(qwen3_30b: Path, capsys: pytest.CaptureFixture, mib: int) -> None:
    out = plan_json(capsys, str(qwen3_30b), "--mib", str(mib))
    plan = out["plans"][0]
    used = sum(g["num_slots"] * g["slot_bytes"] for g in plan["groups"])
    assert used == plan["cache_bytes"] <= mib * MiB
    group = plan["groups"][0]
    assert group["layers"] == list(range(48)) and group["slot_bytes"] == 3 * 768 * 2048 // 256 * 144
    assert group["num_slots"] <= 48 * 128 and group["largest_cached_batch"] == 32


def test_smallest_useful_budget_caches_top_k_and_one_mib_less_is_refused(
        qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    smallest = plan_json(capsys, str(qwen3_30b))["plans"][0]["smallest_useful_mib"]
    plan = plan_json(capsys, str(qwen3_30b), "--mib", str(smallest))["plans"][0]
    assert [g["num_slots"] for g in plan["groups"]] == [8]
    assert main(["plan", str(qwen3_30b), "--mib", str(smallest - 1)]) == 2
    assert f"smallest useful budget is {smallest} MiB" in capsys.readouterr().err


def test_n_cpu_moe_plans_only_the_first_layers(qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    plan = plan_json(capsys, str(qwen3_30b), "--mib", "500", "--n-cpu-moe", "12")["plans"][0]
    assert plan["groups"][0]["layers"] == list(range(12))


def test_trace_gives_a_hit_rate_per_policy(qwen3_30b: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = synthetic_trace("qwen3", num_layers=48, num_experts=128, top_k=8, num_tokens=96, seed=1)
    trace.save(tmp_path / "trace.npz")
    small = plan_json(capsys, str(qwen3_30b), "--mib", "400", "--trace", str(tmp_path / "trace.npz"))
    large = plan_json(capsys, str(qwen3_30b), "--mib", "8000", "--trace", str(tmp_path / "trace.npz"))
    small_rates, large_rates = small["plans"][0]["predicted_hit_ratio"], large["plans"][0]["predicted_hit_ratio"]
    assert set(small_rates) == {"lru", "decay", "lfru", "static"}
    assert all(0.0 <= r <= 1.0 for r in small_rates.values())
    assert large_rates["lru"] > small_rates["lru"]


def test_table_output_names_the_smallest_budget(qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(qwen3_30b), "--mib", "1000"]) == 0
    out = capsys.readouterr().out
    assert "smallest useful cache 21 MiB" in out and "0-47" in out


# preset -> its MoE layers and the bytes of one expert (gate and up Q4_K; rows that are not whole 256-column
# blocks fall back to Q8_0, 34 bytes per 32 columns; MXFP4: 17 bytes per 32 columns; Q4_0: 18 bytes per 32)
REAL_SHAPES = {
    "deepseek-v2-lite": (list(range(1, 27)), 2 * 1408 * 2048 // 256 * 144 + 2048 * 1408 // 32 * 34),
    "gpt-oss-20b": (list(range(24)), 3 * 2880 * 2880 // 32 * 17),
    "gemma4-26b-a4b": (list(range(30)), 3 * 704 * 2816 // 32 * 18),  # 3.35 MB
}


@pytest.mark.parametrize("preset", list(REAL_SHAPES))
def test_plan_of_each_architecture_at_real_shapes(preset: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / f"{preset}.gguf"
    write_synth(path, PRESETS[preset], build_embedded_vocab(), sparse=True)
    layers, slot_bytes = REAL_SHAPES[preset]
    group = plan_json(capsys, str(path), "--mib", "2000")["plans"][0]["groups"][0]
    assert group["layers"] == layers and group["slot_bytes"] == slot_bytes
    assert group["num_slots"] == 2000 * MiB // slot_bytes
