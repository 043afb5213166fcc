"""Fixtures of the job API tests: a tiny GGUF, a job store on SQLite or on the session's real
PostgreSQL server, and a real server (HTTP + gRPC + job worker) over it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from service.grpc_api.stubs import Stubs, load
from service.openai.limits import Limits
from service.server import ServeOptions
from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, write_synth

SERVICE_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SERVICE_TESTS))
from job_servers import ServerThread, engine_config, job_options  # noqa: E402
from pg_server import PostgresServer, postgres_server  # noqa: E402, F401  (fixture)

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synth(path, PRESETS["tiny"], build_embedded_vocab(), seed=7)
    return path


@pytest.fixture(scope="session")
def stubs() -> Stubs:
    return load()


@pytest.fixture(scope="module", params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An empty job store for one test module: a SQLite file, or a fresh schema on the real PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('jobs') / 'jobs.db'}"
        return
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    url = pg.create_schema()
    yield url
    pg.drop_schema(url)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path, store_url: str) -> Iterator[ServerThread]:
    """Two jobs at once, so a third one waits in the queue."""
    options = ServeOptions(port=0, grpc_port=0, limits=Limits(max_tokens=200), jobs=job_options(store_url))
    srv = ServerThread(engine_config(tiny_gguf), options).start()
    yield srv
    srv.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
