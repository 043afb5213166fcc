from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.jobs import JobStore, open_store

# tests/service holds pg_server.py, shared with the other service test folders
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pg_server import postgres_server, postgres_url  # noqa: E402, F401  (fixtures)

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL to an empty store: a SQLite file, or a fresh database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[JobStore]:
    opened = open_store(store_url)
    yield opened
    opened.close()
