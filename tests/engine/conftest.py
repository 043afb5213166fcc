from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.gguf.embedded_vocab import build_embedded_vocab, build_vocab
from engine.synth import PRESETS, with_overrides, write_synth


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


@pytest.fixture(scope="session")
def preset_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A preset's random-weight model with its family's tokenizer, written once per session."""
    written: dict[str, Path] = {}

    def path_of(name: str) -> Path:
        if name not in written:
            preset = PRESETS[name]
            written[name] = tmp_path_factory.mktemp("presets") / f"{name}.gguf"
            write_synth(written[name], preset, build_vocab(preset.vocab), seed=5)
        return written[name]

    return path_of
