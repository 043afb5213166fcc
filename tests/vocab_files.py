"""llama.cpp's ggml-vocab-*.gguf files (tokenizer metadata and test vectors) from the shared data."""

from __future__ import annotations

import pickle
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

from engine.gguf.tokenizer import Tokenizer

KNOWN_VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "qwen2")


def gguf_metadata(path: Path, cache_dir: Path | None) -> dict[str, Any]:
    """Every key/value of a GGUF file as plain Python values (str, int, float, bool, lists).

    GGUFReader needs seconds for a 150k-token vocabulary, so the values are kept in pytest's cache."""
    stat = path.stat()
    cached = cache_dir / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}.pickle" if cache_dir else None
    if cached is not None and cached.exists():
        return pickle.loads(cached.read_bytes())
    metadata = {name: field.contents() for name, field in GGUFReader(path).fields.items()}
    if cached is not None:
        cached.write_bytes(pickle.dumps(metadata))
    return metadata


class VocabFiles:
    """llama.cpp's ggml-vocab-*.gguf files with their .inp/.out test vectors."""

    def __init__(self, directory: Path, cache_dir: Path | None) -> None:
        self.directory = directory
        self.cache_dir = cache_dir

    def path(self, name: str) -> Path:
        path = self.directory / f"ggml-vocab-{name}.gguf"
        if not path.exists():
            pytest.skip(f"{path.name} not present in {self.directory}")
        return path

    @cache  # noqa: B019 - one instance per test session
    def metadata(self, name: str) -> dict[str, Any]:
        return gguf_metadata(self.path(name), self.cache_dir)

    @cache  # noqa: B019 - one instance per test session
    def tokenizer(self, name: str) -> Tokenizer:
        return Tokenizer.from_metadata(self.metadata(name))

    def others(self) -> list[str]:
        """Names of vocab files with test vectors besides the known ones."""
        names = [
            p.name[len("ggml-vocab-") : -len(".gguf")]
            for p in sorted(self.directory.glob("ggml-vocab-*.gguf"))
        ]
        return [
            n
            for n in names
            if n not in KNOWN_VOCABS and (self.directory / f"ggml-vocab-{n}.gguf.inp").exists()
        ]
