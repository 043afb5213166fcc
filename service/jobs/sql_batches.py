"""Files and batches of the OpenAI Batch API over any `Database`: the storage half the HTTP layer's
batch runner builds on (it parses input files into jobs and writes output files)."""

from __future__ import annotations

import builtins
import dataclasses
import re
from typing import Any

from service.jobs.db import Database, Tx
from service.jobs.queries import CANCEL_JOBS_WHERE, check_one_of, select_page
from service.jobs.rows import FILE_COLUMNS, batch_from_row, dumps, file_from_row, new_id
from service.jobs.store import BATCH_STATUSES, Batch, BatchRequestCounts, BatchStatus, FileObject

_INSERT_FILE = f"""
INSERT INTO files (id, purpose, filename, bytes, created_at, data)
VALUES (?, ?, ?, ?, {{now}}, ?) RETURNING {FILE_COLUMNS}"""

_INSERT_BATCH = """
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata)
VALUES (?, ?, ?, ?, 'validating', {now}, {now} + ?, ?) RETURNING *"""

_UNFINISHED_BATCH = "status NOT IN ('failed', 'completed', 'expired', 'cancelled')"

_CANCEL_BATCH = """
UPDATE batches SET status = 'cancelling', cancelling_at = {now}
WHERE id = ? AND status IN ('validating', 'in_progress')"""

_COMPLETION_WINDOW = re.compile(r"([1-9][0-9]*)h")


class SqlBatches:
    _db: Database

    def create_file(self, purpose: str, filename: str, data: bytes) -> FileObject:
        with self._db.transaction() as tx:
            row = tx.one(_INSERT_FILE, (new_id("file-"), purpose, filename, len(data), data))
        assert row is not None  # INSERT ... RETURNING always yields its row
        return file_from_row(row)

    def get_file(self, file_id: str) -> FileObject | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", (file_id,))
        return None if row is None else file_from_row(row)

    def file_content(self, file_id: str) -> bytes | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one("SELECT data FROM files WHERE id = ?", (file_id,))
        return None if row is None else bytes(row["data"])

    def list_files(
        self, *, purpose: str | None = None, limit: int = 100, after: str | None = None
    ) -> builtins.list[FileObject]:
        with self._db.transaction(write=False) as tx:
            equals = {"purpose": purpose}
            rows = select_page(tx, "files", FILE_COLUMNS, limit=limit, after=after, equals=equals)
        return [file_from_row(row) for row in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._db.transaction() as tx:
            return tx.run("DELETE FROM files WHERE id = ?", (file_id,)) == 1

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        window_s = _window_seconds(completion_window)
        params = (new_id("batch_"), endpoint, input_file_id, completion_window, window_s, dumps(metadata))
        with self._db.transaction() as tx:
            row = tx.one(_INSERT_BATCH, params)
        assert row is not None  # INSERT ... RETURNING always yields its row
        return batch_from_row(row)

    def get_batch(self, batch_id: str) -> Batch | None:
        with self._db.transaction(write=False) as tx:
            return _get_batch(tx, batch_id)

    def list_batches(self, *, limit: int = 20, after: str | None = None) -> builtins.list[Batch]:
        with self._db.transaction(write=False) as tx:
            rows = select_page(tx, "batches", "*", limit=limit, after=after, equals={})
        return [batch_from_row(row) for row in rows]

    def update_batch(
        self,
        batch_id: str,
        *,
        status: BatchStatus | None = None,
        output_file_id: str | None = None,
        error_file_id: str | None = None,
        request_counts: BatchRequestCounts | None = None,
        errors: dict[str, Any] | None = None,
    ) -> Batch | None:
        assignments, params = _batch_changes(status, output_file_id, error_file_id, request_counts, errors)
        with self._db.transaction() as tx:
            if assignments:
                sql = f"UPDATE batches SET {', '.join(assignments)} WHERE id = ? AND {_UNFINISHED_BATCH}"
                tx.run(sql, (*params, batch_id))
            return _get_batch(tx, batch_id)

    def cancel_batch(self, batch_id: str) -> Batch | None:
        with self._db.transaction() as tx:
            if tx.run(_CANCEL_BATCH, (batch_id,)) == 1:
                tx.run(CANCEL_JOBS_WHERE + "batch_id = ?", (batch_id,))
            return _get_batch(tx, batch_id)


def _get_batch(tx: Tx, batch_id: str) -> Batch | None:
    row = tx.one("SELECT * FROM batches WHERE id = ?", (batch_id,))
    return None if row is None else batch_from_row(row)


def _batch_changes(
    status: str | None,
    output_file_id: str | None,
    error_file_id: str | None,
    request_counts: BatchRequestCounts | None,
    errors: dict[str, Any] | None,
) -> tuple[list[str], list[Any]]:
    """SET clauses and their parameters for the fields that were given."""
    if status is not None:
        check_one_of("batch status", status, BATCH_STATUSES)
    given: dict[str, Any] = {
        "status": status,
        "output_file_id": output_file_id,
        "error_file_id": error_file_id,
        "errors": dumps(errors),
    }
    if request_counts is not None:
        given |= dataclasses.asdict(request_counts)  # the total, completed and failed columns
    changes = {column: value for column, value in given.items() if value is not None}
    assignments = [f"{column} = ?" for column in changes]
    if status is not None and status != "validating":
        # stamped the first time the batch reaches the status, as OpenAI does
        assignments.append(f"{status}_at = COALESCE({status}_at, {{now}})")
    return assignments, list(changes.values())


def _window_seconds(completion_window: str) -> int:
    match = _COMPLETION_WINDOW.fullmatch(completion_window)
    if match is None:
        raise ValueError(f"completion_window must be a number of hours like '24h', got {completion_window!r}")
    return int(match.group(1)) * 3600
