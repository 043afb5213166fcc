from __future__ import annotations

from pathlib import Path

import pytest

from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, with_overrides, write_synth


@pytest.fixture(scope="session")
def vocab() -> dict:
    return build_embedded_vocab()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, vocab: dict) -> Path:
    """A random-weight Qwen3-MoE with the real embedded tokenizer: 2 layers, 8 experts, top-2, Q4_K."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synth(path, PRESETS["tiny"], vocab, seed=7)
    return path


@pytest.fixture(scope="session")
def small_moe_gguf(tmp_path_factory: pytest.TempPathFactory, vocab: dict) -> Path:
    """Four MoE layers of 16 experts, top-4: enough experts for the cache to matter."""
    path = tmp_path_factory.mktemp("models") / "small.gguf"
    write_synth(path, with_overrides(PRESETS["tiny"], num_layers=4, num_experts=16, top_k=4), vocab, seed=11)
    return path
