"""GGUF reading: metadata, tensors as zero-copy views of the map, split files, and clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.gguf.reader import GGUFError, GGUFFile
from engine.llm_engine import LLMEngine
from engine.weights import load_weights
from ops.quants import QType
from tools.gguf_writer import TensorSpec, tensor_from_float, write_gguf


def write_small(path: Path, split_max_bytes: int = 0) -> list[Path]:
    gen = torch.Generator().manual_seed(0)
    tensors = [tensor_from_float(f"t{i}", torch.randn(4, 64, generator=gen), QType.Q8_0) for i in range(5)]
    md = {"general.name": "small", "small.count": 5, "small.ratio": 0.5, "small.flag": True,
          "small.names": ["a", "b"], "small.ids": [1, -2, 3]}
    return write_gguf(path, "small", md, tensors, split_max_bytes=split_max_bytes)


def test_metadata_and_tensors_round_trip(tmp_path: Path) -> None:
    write_small(tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.architecture == "small"
    assert f.metadata["small.count"] == 5 and f.metadata["small.flag"] is True
    assert f.metadata["small.names"] == ["a", "b"] and f.metadata["small.ids"] == [1, -2, 3]
    assert abs(f.metadata["small.ratio"] - 0.5) < 1e-7
    t = f.tensor("t3", (4, 64))
    assert t.qtype == QType.Q8_0 and t.raw().shape == (4, 68)
    assert isinstance(t.data.base, np.ndarray) or isinstance(t.data, np.memmap)  # a view, not a copy


def test_tensor_bytes_are_views_of_the_map(tmp_path: Path) -> None:
    write_small(tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    t = f.tensor("t1")
    base = f._readers[0].data
    start = t.raw().ctypes.data - base.ctypes.data
    assert 0 < start < len(base)
    assert bytes(base[start:start + t.num_bytes]) == t.raw().tobytes()


def test_split_files_read_as_one_model(tmp_path: Path) -> None:
    paths = write_small(tmp_path / "m.gguf", split_max_bytes=700)
    assert len(paths) >= 3 and paths[0].name == f"m-00001-of-{len(paths):05d}.gguf"
    whole = GGUFFile(paths[1])  # any file of the split opens the whole model
    assert sorted(whole.tensors) == [f"t{i}" for i in range(5)]
    assert whole.metadata["small.count"] == 5
    single = tmp_path / "single.gguf"
    write_small(single)
    for name in whole.tensors:
        assert np.array_equal(whole.tensor(name).raw(), GGUFFile(single).tensor(name).raw())


def test_missing_split_file_is_named(tmp_path: Path) -> None:
    paths = write_small(tmp_path / "m.gguf", split_max_bytes=700)
    paths[-1].unlink()
    with pytest.raises(GGUFError, match=paths[-1].name):
        GGUFFile(paths[0])


def test_non_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model")
    with pytest.raises(GGUFError, match=r"notes.gguf: not a GGUF file"):
        GGUFFile(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_small(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(GGUFError, match=r"m.gguf: tensor 't4' .*truncated"):
        GGUFFile(path)


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_small(path)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(GGUFError, match="m.gguf"):
        GGUFFile(path)


def test_model_errors_name_file_and_tensor(tmp_path: Path, tiny_gguf: Path) -> None:
    src = GGUFFile(tiny_gguf)

    def rewrite(path: Path, drop: str | None = None, reshape: str | None = None, arch: str | None = None) -> Path:
        md = {k: v for k, v in src.metadata.items()}
        if arch:
            md = {k.replace("qwen3moe.", f"{arch}."): v for k, v in md.items()}
        specs = []
        for info in src:
            if info.name == drop:
                continue
            shape = (info.shape[0] * 2, info.shape[1] // 2) if info.name == reshape else info.shape
            specs.append(TensorSpec(info.name, shape, info.qtype, lambda info=info: info.raw()))
        write_gguf(path, arch or src.architecture, md, specs)
        return path

    cpu = torch.device("cpu")
    with pytest.raises(GGUFError, match=r"missing.gguf: tensor 'blk.1.attn_q.weight' is missing"):
        load_weights(GGUFFile(rewrite(tmp_path / "missing.gguf", drop="blk.1.attn_q.weight")), cpu, torch.float32)
    with pytest.raises(GGUFError, match=r"shape.gguf: tensor 'token_embd.weight' has shape"):
        load_weights(GGUFFile(rewrite(tmp_path / "shape.gguf", reshape="token_embd.weight")), cpu, torch.float32)
    with pytest.raises(GGUFError, match=r"arch.gguf: unsupported architecture 'gpt5'"):
        load_weights(GGUFFile(rewrite(tmp_path / "arch.gguf", arch="gpt5")), cpu, torch.float32)


def test_unsupported_tensor_type_is_named(tmp_path: Path, tiny_gguf: Path) -> None:
    src = GGUFFile(tiny_gguf)
    def iq() -> np.ndarray:  # IQ2_XXS: 66 bytes per 256 weights
        return np.zeros((256, 66), np.uint8)

    specs = [TensorSpec(i.name, i.shape, QType.IQ2_XXS, iq) if i.name == "blk.0.attn_q.weight" else
             TensorSpec(i.name, i.shape, i.qtype, lambda i=i: i.raw()) for i in src]
    path = tmp_path / "iq.gguf"
    write_gguf(path, src.architecture, src.metadata, specs)
    with pytest.raises(GGUFError, match=r"iq.gguf: tensor 'blk.0.attn_q.weight' has unsupported type IQ2_XXS"):
        load_weights(GGUFFile(path), torch.device("cpu"), torch.float32)


def test_engine_cli_error_for_non_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(GGUFError, match="x.gguf"):
        LLMEngine(EngineConfig(model=ModelConfig(str(path))))
