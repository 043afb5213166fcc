"""The embedded default model: a small random-weight Qwen3-MoE with a real BPE tokenizer, generated
deterministically on first use (no download), so `moecache serve` runs on a fresh machine."""

from __future__ import annotations

import os
from pathlib import Path

from engine.gguf.embedded_vocab import build_embedded_vocab
from engine.synth import PRESETS, write_synth

VERSION = 1
SEED = 20261129


def cache_dir() -> Path:
    return Path(os.environ.get("MOECACHE_CACHE_DIR", Path.home() / ".cache" / "moecache"))


def embedded_model_path() -> Path:
    """The embedded model's GGUF file, written on first use (atomically: a crash leaves no half file)."""
    path = cache_dir() / f"embedded-v{VERSION}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        write_synth(partial, PRESETS["embedded"], build_embedded_vocab(), seed=SEED)
        os.replace(partial, path)
    return path
