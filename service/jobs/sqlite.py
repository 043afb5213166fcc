"""The embedded job store: one SQLite file (WAL) on one box, shared by threads and processes."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.jobs.db import Database, Dialect, Row, Tx

BUSY_TIMEOUT_S = 30.0
WAL_RETRY_S = 0.01

SQLITE = Dialect(
    param="?",
    now="((julianday('now') - 2440587.5) * 86400.0)",
    # a write transaction holds the database's single write lock, so nothing else is needed
    skip_locked="",
    serialize="",
    serial="INTEGER PRIMARY KEY AUTOINCREMENT",
    float="REAL",
    blob="BLOB",
)


class SqliteDatabase(Database):
    """One connection behind a lock: SQLite runs one writer at a time anyway, and a `:memory:`
    database exists only inside its connection, so every thread must share it."""

    dialect = SQLITE

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._conn.row_factory = _dict_row
        _enable_wal(self._conn)
        # FULL: a commit is on disk before it returns, so even a power loss keeps it
        self._conn.execute("PRAGMA synchronous = FULL")

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[Tx]:
        with self._lock:
            cursor = self._conn.cursor()
            # IMMEDIATE takes the write lock up front: a deferred transaction that later writes fails
            # with SQLITE_BUSY at once, instead of waiting, when another process writes
            cursor.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield Tx(cursor, SQLITE)
                cursor.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    cursor.execute("ROLLBACK")
                raise
            finally:
                cursor.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _enable_wal(conn: sqlite3.Connection) -> None:
    # NOTE: switching a new file to WAL takes its exclusive lock, and SQLite answers "database is locked"
    # at once, without the busy timeout, while another connection does the same: retry until the timeout.
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(WAL_RETRY_S)


def _dict_row(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}
