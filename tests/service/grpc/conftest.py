"""Fixtures of the gRPC tests: a tiny GGUF, a real server (HTTP + gRPC + a SQLite job store) in a
background thread, and a real `grpc.aio` channel with the stubs generated from proto/."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from service.grpc_api.stubs import Stubs, load
from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, write_synth

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job_servers import ServerThread, engine_config, grpc_options, grpc_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synth(path, PRESETS["tiny"], build_embedded_vocab(), seed=7)
    return path


@pytest.fixture(scope="session")
def stubs() -> Stubs:
    return load()


@pytest.fixture(scope="module")
def server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny_gguf), grpc_options(tmp_path_factory.mktemp("grpc"))).start()
    yield srv
    srv.stop()


@pytest.fixture
async def channel(server: ServerThread) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(grpc_target(server)) as chan:
        yield chan
