"""The shared job store: PostgreSQL, so every replica claims from one queue.

Times come from the database clock, so replicas whose clocks disagree still agree on when a lease
expires. Every call runs in its own transaction on a pooled connection (psycopg 3).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from service.jobs.db import Database, Dialect, Tx

DEFAULT_POOL_SIZE = 4
CONNECT_TIMEOUT_S = 10
# any constant shared by every replica: the key of the lock that serializes migrations and queue limits
_LOCK_KEY = 0x6D6F6563  # "moec"

POSTGRES = Dialect(
    param="%s",
    # NOTE: the statement's start, not the transaction's (`now()`): a claim's transaction can begin before
    # a job is submitted and still take it in a later statement; its start would precede the job's creation.
    now="extract(epoch from statement_timestamp())::float8",
    skip_locked="FOR UPDATE SKIP LOCKED",
    serialize=f"SELECT pg_advisory_xact_lock({_LOCK_KEY})",
    serial="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    float="DOUBLE PRECISION",
    blob="BYTEA",
)

Connection = psycopg.Connection[dict[str, Any]]


class ConnectionPool:
    """At most `size` connections, opened on first need; a broken one is dropped, not reused."""

    def __init__(self, url: str, size: int) -> None:
        self._url = url
        self._slots = threading.BoundedSemaphore(size)
        self._idle: queue.LifoQueue[Connection] = queue.LifoQueue()
        self._closed = False
        self._lock = threading.Lock()  # orders returns against close, so none is left open

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        with self._slots:
            conn = self._take()
            try:
                yield conn
            finally:
                self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while not self._idle.empty():
                self._idle.get_nowait().close()

    def _take(self) -> Connection:
        if self._closed:
            raise psycopg.InterfaceError("the job store is closed")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return self._connect()

    def _connect(self) -> Connection:
        return psycopg.connect(self._url, autocommit=True, row_factory=dict_row, connect_timeout=CONNECT_TIMEOUT_S)

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if self._closed or conn.broken or conn.closed:
                conn.close()
            else:
                self._idle.put(conn)


class PostgresDatabase(Database):
    dialect = POSTGRES

    def __init__(self, url: str, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self._pool = ConnectionPool(url, pool_size)

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[Tx]:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cursor:
            yield Tx(cursor, POSTGRES)

    def close(self) -> None:
        self._pool.close()
