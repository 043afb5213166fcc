from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moecache` sets it (service/cli.py), before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.spm_vocab import spm_vocab  # noqa: E402
from tests.vocab_files import VocabFiles  # noqa: E402
from tools.embedded_vocab import build_vocab  # noqa: E402
from tools.synth import PRESETS, with_overrides, write_synth  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MOECACHE_SHARED_DATA", ROOT.parent / "shared" / "data"))
LLAMA_CPP = Path(os.environ.get("MOECACHE_LLAMA_CPP", ROOT.parent / "shared" / "tools" / "llama.cpp-cpu"))
LLAMA_CPP_TOOLS = ("llama-quantize", "llama-perplexity")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA} (set MOECACHE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """The directory of llama.cpp's CPU tools (llama-quantize, llama-perplexity); skips where absent."""
    missing = [t for t in LLAMA_CPP_TOOLS if not os.access(LLAMA_CPP / t, os.X_OK)]
    if missing:
        pytest.skip(f"llama.cpp's {', '.join(missing)} not found in {LLAMA_CPP} (set MOECACHE_LLAMA_CPP)")
    return LLAMA_CPP


@pytest.fixture(scope="session")
def vocabs(shared_data: Path, request: pytest.FixtureRequest) -> VocabFiles:
    """llama.cpp's vocabulary files (tokenizer metadata and test vectors); skips where they are absent."""
    directory = shared_data / "vocab"
    if not directory.is_dir():
        pytest.skip(f"no llama.cpp vocab test files at {directory}")
    pytest_cache = getattr(request.config, "cache", None)
    cache_dir = pytest_cache.mkdir("moecache-gguf-metadata") if pytest_cache is not None else None
    return VocabFiles(directory, cache_dir)


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Mixtral layout (llama) with a SentencePiece vocabulary: 2 layers, 4 experts, top-2."""
    path = tmp_path_factory.mktemp("models") / "tiny-spm.gguf"
    preset = with_overrides(PRESETS["mixtral-8x7b"], num_layers=2, hidden=256, num_heads=4, num_kv_heads=2,
                            head_dim=64, num_experts=4, expert_ff=256, vocab_size=0, context_length=512)
    write_synth(path, preset, spm_vocab(), seed=0)
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
