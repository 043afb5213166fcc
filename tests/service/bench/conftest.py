from __future__ import annotations

from pathlib import Path

import pytest

from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, with_overrides, write_synth


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two MoE layers of 16 experts, top-4, Q4_K experts of 256 x 256 (110,592 bytes each)."""
    path = tmp_path_factory.mktemp("bench-model") / "tiny.gguf"
    preset = with_overrides(PRESETS["tiny"], num_layers=2, num_experts=16, top_k=4)
    write_synth(path, preset, build_embedded_vocab())
    return path
