"""The embedded default model: generated on first use, the same bytes every time, and what a command runs when
it names no model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.gguf.reader import GGUFFile
from engine.types import Request, SamplingParams
from service.engine_setup import load_engine
from tools.embedded import embedded_model_path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generated_once_and_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "a"))
    first = embedded_model_path()
    mtime = first.stat().st_mtime_ns
    assert embedded_model_path() == first and first.stat().st_mtime_ns == mtime  # reused, not rewritten
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "b"))
    second = embedded_model_path()
    assert second != first and digest(second) == digest(first)
    assert not list((tmp_path / "a").glob("*.partial"))


def test_embedded_model_is_a_qwen3_moe_with_a_real_tokenizer(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    engine = load_engine(EngineConfig(model=ModelConfig(None, device="cpu", max_context=128)))  # no model named
    gguf = GGUFFile(embedded_model_path())
    assert gguf.architecture == "qwen3moe" and gguf.metadata["qwen3moe.expert_count"] == 32
    text = "Hello, world! The expert cache keeps hot experts on the GPU."
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text
    engine.add_request(Request("r", tuple(engine.tokenizer.encode(text)),
                               SamplingParams(max_tokens=5, ignore_eos=True)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
