"""Opening stores: URLs, schema versions, and durability across reopen and process death."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import psycopg
import pytest

from service.jobs import JobStore, open_store
from service.jobs.db import SchemaTooNew
from service.jobs.schema import MIGRATIONS

STORE_PROCESS = Path(__file__).with_name("store_process.py")


def _sql(url: str, statement: str) -> list[tuple[object, ...]]:
    """Run one statement on the store's database directly, outside the store."""
    if url.startswith("sqlite:///"):
        with closing(sqlite3.connect(url.removeprefix("sqlite://"))) as conn, conn:
            return conn.execute(statement).fetchall()
    with psycopg.connect(url, autocommit=True) as pg, pg.cursor() as cursor:
        cursor.execute(statement)
        return cursor.fetchall() if cursor.description else []


def test_unknown_scheme_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="'mysql'"):
        open_store("mysql://user@host/db")


def test_url_without_scheme_is_rejected() -> None:
    with pytest.raises(ValueError, match="no scheme"):
        open_store("/var/lib/jobs.db")


def test_relative_sqlite_path_is_rejected() -> None:
    with pytest.raises(ValueError, match="absolute path"):
        open_store("sqlite://jobs.db")


def test_memory_store_is_shared_by_threads() -> None:
    with open_store("sqlite:///:memory:") as store:
        threads = [threading.Thread(target=store.create, args=("chat", {"i": i})) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert store.counts()["queued"] == 8


def test_postgres_scheme_alias_opens_the_same_database(postgres_url: str) -> None:
    with open_store(postgres_url) as store:
        job = store.create("completion", {"prompt": "x"})
    with open_store(postgres_url.replace("postgresql://", "postgres://", 1)) as alias:
        assert alias.get(job.id) == job


def test_reopen_keeps_the_schema_at_one_version(store_url: str) -> None:
    for _ in range(2):
        open_store(store_url).close()

    assert _sql(store_url, "SELECT version FROM schema_version") == [(len(MIGRATIONS),)]


def test_a_newer_schema_is_refused(store_url: str) -> None:
    open_store(store_url).close()
    _sql(store_url, f"UPDATE schema_version SET version = {len(MIGRATIONS) + 1}")

    with pytest.raises(SchemaTooNew):
        open_store(store_url)


def _fill(store: JobStore) -> tuple[str, str, str, str]:
    queued = store.create("chat", {"messages": [{"role": "user", "content": "q"}]})
    store.create("completion", {"prompt": "done"})
    running = store.claim("w1", 30.0)
    assert running is not None
    store.append(running.id, "w1", "abc", [1, 2, 3])
    store.finish(running.id, "w1", "succeeded", result={"text": "abc"})
    file = store.create_file("batch", "input.jsonl", b'{"custom_id": "a"}\n')
    batch = store.create_batch(file.id, "/v1/chat/completions", "24h", {"team": "x"})
    return queued.id, running.id, file.id, batch.id


def test_everything_survives_close_and_reopen(store_url: str) -> None:
    with open_store(store_url) as store:
        ids = _fill(store)
        before = (store.get(ids[0]), store.get(ids[1]), store.events(ids[1]), store.get_batch(ids[3]))

    with open_store(store_url) as reopened:
        after = (reopened.get(ids[0]), reopened.get(ids[1]), reopened.events(ids[1]), reopened.get_batch(ids[3]))
        assert after == before
        assert reopened.file_content(ids[2]) == b'{"custom_id": "a"}\n'
        assert reopened.counts() == {"queued": 1, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 0}


def test_a_killed_process_loses_nothing_it_committed(store_url: str) -> None:
    with open_store(store_url) as store:
        job = store.create("completion", {"prompt": "x"})

    done = subprocess.run([sys.executable, str(STORE_PROCESS), "crash", store_url, job.id], timeout=60)

    assert done.returncode == -9
    with open_store(store_url) as reopened:
        final = reopened.get(job.id)
        assert final is not None
        assert (final.status, final.text, final.result) == ("succeeded", "persisted", {"done": True})
        assert [e.token_ids for e in reopened.events(job.id)] == [(1, 2)]


def test_a_connection_the_server_dropped_is_replaced(postgres_url: str) -> None:
    with open_store(postgres_url) as store:
        job = store.create("completion", {"prompt": "x"})
        terminated = _sql(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid() AND datname = current_database() AND backend_type = 'client backend'",
        )
        assert terminated == [(True,)]

        with pytest.raises(psycopg.OperationalError):
            store.get(job.id)
        assert store.get(job.id) == job
