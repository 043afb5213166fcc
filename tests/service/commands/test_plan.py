"""`moecache plan` on a model with the real Qwen3-30B-A3B shapes (a sparse GGUF: headers, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.arch import get_arch
from engine.arch.base import HParams
from engine.gguf.reader import GGUFFile
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
    # 48 layers x 33 slots (32 sequences + the scratch slot) x 4096 positions x 4 kv heads x 2 x 256 bytes
    assert "KV cache: 12672 MiB (K bf16, V bf16; 32 sequences of 4096 positions)" in out


def test_kv_cache_counts_the_bytes_of_its_types(qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    one_long = ("--mib", "1000", "-c", "32768", "--max-num-seqs", "1")
    runs = {types: plan_json(capsys, str(qwen3_30b), *one_long, "-ctk", types[0], "-ctv", types[1])
            for types in (("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"))}
    rows = 48 * 2 * 32768 * 4  # layers, slots (the sequence and the scratch slot), positions, kv heads
    row_bytes = {"bf16": 256, "q8_0": 4 * 34, "q4_0": 4 * 18}  # one head's 128 values
    for (k_type, v_type), out in runs.items():
        assert out["kv_cache"] == {"bytes": rows * (row_bytes[k_type] + row_bytes[v_type]), "k_type": k_type,
                                   "v_type": v_type, "positions": 32768, "sequences": 1}
        plan = out["plans"][0]
        assert plan["device_bytes"] == plan["cache_bytes"] + out["kv_cache"]["bytes"]
    both = plan_json(capsys, str(qwen3_30b), *one_long, "--kv-cache-dtype", "q8_0")
    assert both["kv_cache"] == runs[("q8_0", "q8_0")]["kv_cache"]


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


def layout_bytes(hp: HParams, slots: int, positions: int, k_type: str, v_type: str) -> int:
    """The KV cache's bytes from the hyperparameters: MLA's latent once per token and layer; else each layer's
    own K and V rows (none for a shared-KV layer), a row per kv head of that layer's head_dim."""
    if hp.mla is not None:
        return hp.num_layers * slots * positions * hp.mla.latent_dim * 2
    row = {"bf16": lambda d: 2 * d, "q8_0": lambda d: d // 32 * 34, "q4_0": lambda d: d // 32 * 18}
    return sum(slots * positions * hp.kv_heads_of(i) * (row[k_type](hp.head_dim_of(i)) + row[v_type](hp.head_dim_of(i)))
               for i in range(hp.num_layers) if hp.kv_layer(i) == i)


@pytest.mark.parametrize("preset", list(REAL_SHAPES))
def test_kv_cache_of_each_architecture(preset: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / f"{preset}.gguf"
    write_synth(path, PRESETS[preset], build_embedded_vocab(), sparse=True)
    hp = get_arch(GGUFFile(path).architecture).hparams(GGUFFile(path).metadata, vocab_size=0)
    args = ("--mib", "2000", "-c", "1024", "--max-num-seqs", "3")
    out = plan_json(capsys, str(path), *args)
    assert out["kv_cache"]["bytes"] == layout_bytes(hp, 4, 1024, "bf16", "bf16")
    if hp.mla is not None:  # the latent cache stays in bf16
        assert main(["plan", str(path), *args, "-ctk", "q8_0"]) == 2
        err = capsys.readouterr().err
        assert "MLA latent" in err and "got K q8_0, V bf16" in err and "--cache-type-k" in err
        return
    quantized = plan_json(capsys, str(path), *args, "-ctk", "q8_0", "-ctv", "q4_0")
    assert quantized["kv_cache"]["bytes"] == layout_bytes(hp, 4, 1024, "q8_0", "q4_0")
    assert 0 < quantized["kv_cache"]["bytes"] < out["kv_cache"]["bytes"]


def test_the_host_ram_tier_of_a_budget(qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    expert = 3 * 768 * 2048 // 256 * 144  # one Q4_K expert
    tier = plan_json(capsys, str(qwen3_30b), "--mib", "100", "--host-cache-mib", "4096")["ram_tier"]
    assert tier == {"budget_mib": 4096, "slot_bytes": expert, "slots": 4096 * MiB // expert,
                    "share": 4096 * MiB // expert / (48 * 128), "fits_a_token": True}
    assert not plan_json(capsys, str(qwen3_30b), "--mib", "100", "--host-cache-mib", "10")["ram_tier"]["fits_a_token"]


def test_devices_split_the_layers_and_the_budget_by_host_expert_bytes(qwen3_30b: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = plan_json(capsys, str(qwen3_30b), "--mib", "4000", "--devices", "cuda:0,cuda:1", "--tensor-split", "3,1")
    plan = out["plans"][0]
    devices = plan["devices"]
    assert [(d["device"], d["layers"]) for d in devices] == [("cuda:0", [0, 35]), ("cuda:1", [36, 47])]
    # every layer's experts are alike: host expert bytes 3:1, the budget too, adding up to the budget
    assert devices[0]["host_expert_bytes"] == 3 * devices[1]["host_expert_bytes"]
    assert [d["budget_bytes"] for d in devices] == [3000 * MiB, 1000 * MiB]
    assert sum(d["cache_bytes"] for d in devices) == plan["cache_bytes"] <= 4000 * MiB
    assert [g["layers"] for g in plan["groups"]] == [list(range(36)), list(range(36, 48))]
    assert sum(d["kv_bytes"] for d in devices) == out["kv_cache"]["bytes"]
    assert main(["plan", str(qwen3_30b), "--mib", "4000", "--devices", "cuda:0,cuda:1"]) == 0
    table = capsys.readouterr().out
    assert "cuda:0: layers 0-23, budget 2000 MiB" in table and "cuda:1: layers 24-47, budget 2000 MiB" in table


def test_a_bad_device_list_is_a_clear_error(qwen3_30b: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(qwen3_30b), "--devices", "cuda:0,gpu1"]) == 2
    assert "--devices takes a comma-separated list of cpu or cuda:N" in capsys.readouterr().err
    assert main(["plan", str(qwen3_30b), "--devices", "cuda:0,cuda:1", "--tensor-split", "1"]) == 2
    assert "--tensor-split has 1 shares for 2 devices" in capsys.readouterr().err
