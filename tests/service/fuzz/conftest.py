"""Fixtures of the fuzz test: a tiny GGUF, and `moecache serve` over it with a job store on SQLite, then
on the session's real PostgreSQL."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.embedded_vocab import build_embedded_vocab
from tools.synth import PRESETS, write_synth

FUZZ = Path(__file__).resolve().parent
sys.path.insert(0, str(FUZZ))
sys.path.insert(0, str(FUZZ.parent))
from fuzz_server import BACKENDS, SERVER_ARGS, FuzzServer, make_ids  # noqa: E402
from job_servers import ServeProcess  # noqa: E402
from pg_server import PostgresServer, postgres_server  # noqa: E402, F401  (fixture)


@pytest.fixture(scope="session")
def fuzz_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz-model") / "tiny.gguf"
    write_synth(path, PRESETS["tiny"], build_embedded_vocab(), seed=7)
    return path


@pytest.fixture(scope="module", params=list(BACKENDS))
def fuzz_server(request: pytest.FixtureRequest, fuzz_gguf: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzServer]:
    pg: PostgresServer | None = request.getfixturevalue("postgres_server") if request.param == "postgresql" else None
    store = pg.create_schema() if pg else f"sqlite:///{tmp_path_factory.mktemp('fuzz-jobs') / 'jobs.db'}"
    process = ServeProcess(fuzz_gguf, store, *SERVER_ARGS).wait_ready(120)
    try:
        ids = asyncio.run(make_ids(f"http://127.0.0.1:{process.port}"))
        yield FuzzServer(process, ids, BACKENDS[request.param])
    finally:
        process.proc.send_signal(signal.SIGTERM)
        process.proc.wait(60)
        if pg:
            pg.drop_schema(store)
