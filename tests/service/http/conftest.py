"""Fixtures of the HTTP tests: a tiny random-weight GGUF with the real embedded tokenizer, a shared
real server, the official `openai` client and a raw aiohttp session."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from service.openai.limits import Limits
from service.server import ServeOptions
from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, write_synth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_servers import MODEL, ServerThread, engine_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3-MoE with the real embedded tokenizer: 2 layers, 8 experts, top-2, Q4_K."""
    path = tmp_path_factory.mktemp("models") / f"{MODEL}.gguf"
    write_synth(path, PRESETS["tiny"], build_embedded_vocab(), seed=7)
    return path


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[ServerThread]:
    """The shared server: defaults, experts behind a small cache so the cache metrics move."""
    srv = ServerThread(engine_config(tiny_gguf, cached=True),
                       ServeOptions(port=0, limits=Limits(max_tokens=200, max_n=4, max_stop_strings=3,
                                                          max_body_bytes=64 * 1024))).start()
    yield srv
    srv.stop()


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[AsyncOpenAI]:
    oai = AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    yield oai
    await oai.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
