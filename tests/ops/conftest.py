from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.cpu_experts import NativeExperts, load_native


@pytest.fixture(scope="session", autouse=True)
def native_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Native kernels built into a fresh cache, with the default compiler."""
    path = tmp_path_factory.mktemp("moecache-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOECACHE_CACHE_DIR", str(path))
        mp.delenv("CC", raising=False)
        yield path


@pytest.fixture(scope="module")
def lib() -> NativeExperts:
    """The native CPU kernel library (built once per cache)."""
    lib = load_native()
    if lib is None:
        pytest.skip("no C compiler")
    return lib
