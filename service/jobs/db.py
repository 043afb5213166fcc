"""What the job store needs from a database: transactions, a dialect, and schema migration (SQLite on
one box, `sqlite.py`, or PostgreSQL shared by replicas, `postgres.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

Row = dict[str, Any]


class Cursor(Protocol):
    """The DB-API subset used here (sqlite3 and psycopg cursors both fit)."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, params: Sequence[Any], /) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Dialect:
    """SQL fragments that differ between databases. Statements are written once, with `?` placeholders
    and `{name}` slots filled from these fields (constants only, never data)."""

    param: str  # the driver's placeholder
    now: str  # unix seconds from the database clock
    skip_locked: str  # row lock for queue scans, empty where a transaction already excludes writers
    serialize: str  # statement taking a transaction-wide lock, empty where writers are serialized anyway
    serial: str  # auto-numbered primary key column type
    float: str
    blob: str

    def render(self, sql: str) -> str:
        return _render(self, sql)


@lru_cache(maxsize=512)
def _render(dialect: Dialect, sql: str) -> str:
    filled = sql.format(
        now=dialect.now,
        skip_locked=dialect.skip_locked,
        serial=dialect.serial,
        float=dialect.float,
        blob=dialect.blob,
    )
    return filled.replace("?", dialect.param)


class Tx:
    """One open transaction."""

    def __init__(self, cursor: Cursor, dialect: Dialect) -> None:
        self._cursor = cursor
        self.dialect = dialect

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        self._cursor.execute(self.dialect.render(sql), params)
        row: Row | None = self._cursor.fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        self._cursor.execute(self.dialect.render(sql), params)
        return list(self._cursor.fetchall())

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute a statement; returns the number of rows it changed."""
        self._cursor.execute(self.dialect.render(sql), params)
        return self._cursor.rowcount

    def serialize(self) -> None:
        """Block other serializing transactions until this one ends."""
        if self.dialect.serialize:
            self.run(self.dialect.serialize)


class Database(ABC):
    dialect: Dialect

    @abstractmethod
    def transaction(self, *, write: bool = True) -> AbstractContextManager[Tx]:
        """Commit on normal exit, roll back on an exception. Rows come back as dicts."""

    @abstractmethod
    def close(self) -> None: ...


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer version of this server."""


def migrate(db: Database, migrations: Sequence[Sequence[str]]) -> int:
    """Apply the migrations the database has not seen yet; `migrations[i]` takes version i to i + 1.
    Returns the schema version. Safe when several processes open the same database at once."""
    with db.transaction() as tx:
        tx.serialize()
        tx.run("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        version = _schema_version(tx)
        if version > len(migrations):
            raise SchemaTooNew(f"database schema version {version} is newer than {len(migrations)}")
        for statement in _pending(migrations, version):
            tx.run(statement)
        tx.run("DELETE FROM schema_version")
        tx.run("INSERT INTO schema_version (version) VALUES (?)", (len(migrations),))
    return len(migrations)


def _schema_version(tx: Tx) -> int:
    row = tx.one("SELECT MAX(version) AS version FROM schema_version")
    return int(row["version"]) if row and row["version"] is not None else 0


def _pending(migrations: Sequence[Sequence[str]], version: int) -> Iterator[str]:
    for step in migrations[version:]:
        yield from step
