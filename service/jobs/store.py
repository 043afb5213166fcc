"""The job store: the queue, leases and streamed output of jobs, and the files and batches of the OpenAI
Batch API, written once for SQLite and PostgreSQL. Open one with `open_store(url)`.

Every method is synchronous and thread-safe; the asyncio layers call them through `asyncio.to_thread`.
When a state-changing method returns, the change is committed: a process crash loses nothing.
Ownership of a running job is `worker_id` on its row; every write by a worker checks it in the same
statement, so a worker that lost its lease cannot touch the job again.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from service.jobs.db import Database, Row, Tx, migrate
from service.jobs.records import (
    BATCH_STATUSES,
    FINISHED_JOB_STATUSES,
    JOB_KINDS,
    JOB_STATUSES,
    Batch,
    BatchRequestCounts,
    BatchStatus,
    FileObject,
    Job,
    JobEvent,
    JobKind,
    JobStatus,
    NewJob,
    QueueFull,
)
from service.jobs.schema import MIGRATIONS

_INSERT_JOB = """
INSERT INTO jobs (id, kind, request, status, created_at, batch_id, custom_id)
VALUES (?, ?, ?, 'queued', {now}, ?, ?) RETURNING *"""

# NOTE: the scan skips rows another claim has locked, so concurrent claims never wait on each other.
_CLAIM = """
UPDATE jobs SET status = 'running', worker_id = ?, lease_expires_at = {now} + ?,
    attempts = attempts + 1, started_at = COALESCE(started_at, {now})
WHERE id = (
    SELECT id FROM jobs
    WHERE status IN ('queued', 'running')
      AND (status = 'queued' OR lease_expires_at < {now})
    ORDER BY num LIMIT 1 {skip_locked})
RETURNING *"""

# A job whose owner died is not run again when its cancel was requested or it used up its attempts.
_CANCEL_EXPIRED = """
UPDATE jobs SET status = 'cancelled', finished_at = {now}, lease_expires_at = NULL
WHERE id IN (
    SELECT id FROM jobs WHERE status = 'running' AND lease_expires_at < {now} AND cancel_requested
    {skip_locked})"""

_FAIL_EXPIRED = """
UPDATE jobs SET status = 'failed', error = ?, finished_at = {now}, lease_expires_at = NULL
WHERE id IN (
    SELECT id FROM jobs WHERE status = 'running' AND lease_expires_at < {now} AND attempts >= ?
    {skip_locked})"""

_RENEW = """
UPDATE jobs SET lease_expires_at = {now} + ?
WHERE id = ? AND worker_id = ? AND status = 'running'"""

_APPEND = """
UPDATE jobs SET text = text || ?, progress_tokens = progress_tokens + ?, last_seq = last_seq + 1
WHERE id = ? AND worker_id = ? AND status = 'running'
RETURNING last_seq"""

_FINISH = """
UPDATE jobs SET status = ?, result = ?, error = ?, finished_at = {now}, lease_expires_at = NULL
WHERE id = ? AND worker_id = ? AND status = 'running'"""

# Queued jobs end at once; a running job's owner sees the request and finishes it as cancelled.
# Completed with "id = ?" or "batch_id = ?".
_CANCEL_JOBS_WHERE = """
UPDATE jobs SET cancel_requested = TRUE,
    finished_at = CASE WHEN status = 'queued' THEN {now} ELSE finished_at END,
    status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END
WHERE status IN ('queued', 'running') AND """

_FILE_COLUMNS = "id, purpose, filename, bytes, created_at"

_INSERT_FILE = f"""
INSERT INTO files (id, purpose, filename, bytes, created_at, data)
VALUES (?, ?, ?, ?, {{now}}, ?) RETURNING {_FILE_COLUMNS}"""

_INSERT_BATCH = """
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata)
VALUES (?, ?, ?, ?, 'validating', {now}, {now} + ?, ?) RETURNING *"""

_UNFINISHED_BATCH = "status NOT IN ('failed', 'completed', 'expired', 'cancelled')"

_CANCEL_BATCH = """
UPDATE batches SET status = 'cancelling', cancelling_at = {now}
WHERE id = ? AND status IN ('validating', 'in_progress')"""

COMPLETION_WINDOW = re.compile(r"([1-9][0-9]{0,3})h")  # "<hours>h"; at most MAX_WINDOW_H
MAX_WINDOW_H = 24 * 365


class JobStore:
    """Jobs, their streamed output, and the files and batches of the OpenAI Batch API."""

    def __init__(self, db: Database) -> None:
        self._db = db
        migrate(db, MIGRATIONS)

    # -- jobs ------------------------------------------------------------------------------------------
    def create(self, kind: JobKind, request: dict[str, Any], *, batch_id: str | None = None,
               custom_id: str | None = None, max_queued: int | None = None) -> Job:
        """Queue one job. Raises QueueFull when `max_queued` jobs are already queued."""
        return self.create_many([NewJob(kind, request, batch_id, custom_id)], max_queued=max_queued)[0]

    def create_many(self, new_jobs: Sequence[NewJob], *, max_queued: int | None = None) -> builtins.list[Job]:
        """Queue all jobs in one transaction, in order; QueueFull (and nothing queued) if they don't fit."""
        for new_job in new_jobs:
            _check_one_of("kind", new_job.kind, JOB_KINDS)
        with self._db.transaction() as tx:
            if max_queued is not None:
                _check_room(tx, len(new_jobs), max_queued)
            return [_insert_job(tx, new_job) for new_job in new_jobs]

    def get(self, job_id: str) -> Job | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else _job(row)

    def list(self, *, limit: int = 20, after: str | None = None, status: str | None = None) -> builtins.list[Job]:
        """Newest first; `after` is the id of the last job of the previous page."""
        if status is not None:
            _check_one_of("status", status, JOB_STATUSES)
        with self._db.transaction(write=False) as tx:
            rows = _select_page(tx, "jobs", "*", limit=limit, after=after, equals={"status": status})
        return [_job(row) for row in rows]

    def list_batch_jobs(self, batch_id: str) -> builtins.list[Job]:
        """A batch's jobs in the order they were created."""
        with self._db.transaction(write=False) as tx:
            rows = tx.all("SELECT * FROM jobs WHERE batch_id = ? ORDER BY num", (batch_id,))
        return [_job(row) for row in rows]

    def cancel(self, job_id: str) -> Job | None:
        """Queued: cancelled at once. Running: `cancel_requested`, the owner finishes it as cancelled.
        Finished: unchanged. None when the job does not exist."""
        with self._db.transaction() as tx:
            tx.run(_CANCEL_JOBS_WHERE + "id = ?", (job_id,))
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else _job(row)

    def claim(self, worker_id: str, lease_s: float, *, max_attempts: int | None = None) -> Job | None:
        """Take the oldest queued job, or a running one whose lease expired, for `lease_s` seconds.

        Expired jobs that had a cancel requested are finished as cancelled instead of re-run, and with
        `max_attempts` an expired job already claimed that many times is finished as failed.
        NOTE: `worker_id` names one owner; two runners must not share it.
        """
        _check_lease(lease_s)
        with self._db.transaction() as tx:
            tx.run(_CANCEL_EXPIRED)
            if max_attempts is not None:
                tx.run(_FAIL_EXPIRED, (f"the job's worker was lost {max_attempts} times", max_attempts))
            row = tx.one(_CLAIM, (worker_id, lease_s))
        return None if row is None else _job(row)

    def renew(self, job_id: str, worker_id: str, lease_s: float) -> bool:
        """Extend the lease to `lease_s` from now; False when `worker_id` no longer owns the job."""
        _check_lease(lease_s)
        with self._db.transaction() as tx:
            return tx.run(_RENEW, (lease_s, job_id, worker_id)) == 1

    def append(self, job_id: str, worker_id: str, text: str, token_ids: Sequence[int]) -> int | None:
        """Persist one chunk of output (event row and job text in one transaction).
        Returns the chunk's seq, or None when `worker_id` no longer owns the job.
        NUL characters (which PostgreSQL text cannot hold) are stored as U+FFFD on every backend."""
        text = _storable(text)
        with self._db.transaction() as tx:
            row = tx.one(_APPEND, (text, len(token_ids), job_id, worker_id))
            if row is None:
                return None
            seq: int = row["last_seq"]
            insert = "INSERT INTO job_events (job_id, seq, text, token_ids) VALUES (?, ?, ?, ?)"
            tx.run(insert, (job_id, seq, text, json.dumps([int(t) for t in token_ids])))
        return seq

    def events(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> builtins.list[JobEvent]:
        """Chunks with seq > `after_seq`, in order."""
        sql = "SELECT seq, text, token_ids FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq"
        params: builtins.list[Any] = [job_id, after_seq]
        if limit is not None:
            _check_limit(limit)
            sql += " LIMIT ?"
            params.append(limit)
        with self._db.transaction(write=False) as tx:
            rows = tx.all(sql, params)
        return [JobEvent(row["seq"], row["text"], tuple(json.loads(row["token_ids"]))) for row in rows]

    def finish(self, job_id: str, worker_id: str, status: JobStatus, *, result: dict[str, Any] | None = None,
               error: str | None = None) -> bool:
        """Only the current owner can finish a running job; False otherwise. A finished job never changes."""
        _check_one_of("finish status", status, tuple(FINISHED_JOB_STATUSES))
        with self._db.transaction() as tx:
            params = (status, _dumps(result), None if error is None else _storable(error), job_id, worker_id)
            return tx.run(_FINISH, params) == 1

    def counts(self) -> dict[str, int]:
        """Number of jobs in every status (zeros included)."""
        with self._db.transaction(write=False) as tx:
            rows = tx.all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        found = {row["status"]: int(row["n"]) for row in rows}
        return {status: found.get(status, 0) for status in JOB_STATUSES}

    # -- files -----------------------------------------------------------------------------------------
    def create_file(self, purpose: str, filename: str, data: bytes) -> FileObject:
        with self._db.transaction() as tx:
            row = tx.one(_INSERT_FILE, (_new_id("file-"), purpose, filename, len(data), data))
        assert row is not None  # INSERT ... RETURNING always yields its row
        return _file(row)

    def get_file(self, file_id: str) -> FileObject | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,))
        return None if row is None else _file(row)

    def file_content(self, file_id: str) -> bytes | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one("SELECT data FROM files WHERE id = ?", (file_id,))
        return None if row is None else bytes(row["data"])

    def list_files(self, *, purpose: str | None = None, limit: int = 100,
                   after: str | None = None) -> builtins.list[FileObject]:
        """Newest first; `after` is the id of the last file of the previous page."""
        with self._db.transaction(write=False) as tx:
            rows = _select_page(tx, "files", _FILE_COLUMNS, limit=limit, after=after, equals={"purpose": purpose})
        return [_file(row) for row in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._db.transaction() as tx:
            return tx.run("DELETE FROM files WHERE id = ?", (file_id,)) == 1

    # -- batches ---------------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> Batch:
        """A new batch in status "validating"; `completion_window` is "<hours>h"."""
        window_s = window_seconds(completion_window)
        params = (_new_id("batch_"), endpoint, input_file_id, completion_window, window_s, _dumps(metadata))
        with self._db.transaction() as tx:
            row = tx.one(_INSERT_BATCH, params)
        assert row is not None  # INSERT ... RETURNING always yields its row
        return _batch(row)

    def get_batch(self, batch_id: str) -> Batch | None:
        with self._db.transaction(write=False) as tx:
            return _get_batch(tx, batch_id)

    def list_batches(self, *, limit: int = 20, after: str | None = None) -> builtins.list[Batch]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        with self._db.transaction(write=False) as tx:
            rows = _select_page(tx, "batches", "*", limit=limit, after=after, equals={})
        return [_batch(row) for row in rows]

    def update_batch(self, batch_id: str, *, status: BatchStatus | None = None, output_file_id: str | None = None,
                     error_file_id: str | None = None, request_counts: BatchRequestCounts | None = None,
                     errors: dict[str, Any] | None = None) -> Batch | None:
        """Set the given fields; a new status also stamps its `<status>_at` time.
        A finished batch (failed, completed, expired, cancelled) is returned unchanged."""
        assignments, params = _batch_changes(status, output_file_id, error_file_id, request_counts, errors)
        with self._db.transaction() as tx:
            if assignments:
                sql = f"UPDATE batches SET {', '.join(assignments)} WHERE id = ? AND {_UNFINISHED_BATCH}"
                tx.run(sql, (*params, batch_id))
            return _get_batch(tx, batch_id)

    def cancel_batch(self, batch_id: str) -> Batch | None:
        """validating/in_progress -> cancelling, and the batch's jobs are cancelled as by `cancel`.
        The batch runner moves it to cancelled once its running jobs have stopped."""
        with self._db.transaction() as tx:
            if tx.run(_CANCEL_BATCH, (batch_id,)) == 1:
                tx.run(_CANCEL_JOBS_WHERE + "batch_id = ?", (batch_id,))
            return _get_batch(tx, batch_id)

    # -- lifetime --------------------------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_store(url: str) -> JobStore:
    """`sqlite:///abs/path.db`, `sqlite:///:memory:`, or `postgresql://user@host:port/db` (`postgres://`)."""
    return JobStore(_open_database(url))


def _open_database(url: str) -> Database:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"job store url {url!r} has no scheme; use sqlite:///path or postgresql://...")
    if scheme == "sqlite":
        from service.jobs.sqlite import SqliteDatabase

        return SqliteDatabase(_sqlite_path(rest))
    if scheme in ("postgresql", "postgres"):
        from service.jobs.postgres import PostgresDatabase  # psycopg only for PostgreSQL

        return PostgresDatabase(url)
    raise ValueError(f"unknown job store scheme {scheme!r}; use sqlite:///path or postgresql://...")


def _sqlite_path(rest: str) -> str:
    if rest == "/:memory:":
        return ":memory:"
    if not rest.startswith("/") or rest == "/":
        raise ValueError(f"sqlite job store needs an absolute path (sqlite:///abs/path.db), got {rest!r}")
    return rest


def window_seconds(completion_window: str) -> int:
    match = COMPLETION_WINDOW.fullmatch(completion_window)
    if match is None or int(match.group(1)) > MAX_WINDOW_H:
        raise ValueError(f"completion_window must be a number of hours from 1 to {MAX_WINDOW_H} like '24h', "
                         f"got {completion_window[:40]!r}")
    return int(match.group(1)) * 3600


# -- statements --------------------------------------------------------------------------------------------
def _insert_job(tx: Tx, new_job: NewJob) -> Job:
    params = (_new_id("job_"), new_job.kind, json.dumps(new_job.request), new_job.batch_id, new_job.custom_id)
    row = tx.one(_INSERT_JOB, params)
    assert row is not None  # INSERT ... RETURNING always yields its row
    return _job(row)


def _check_room(tx: Tx, num_new: int, max_queued: int) -> None:
    # NOTE: serialized, so two concurrent creates cannot both see the last free place
    tx.serialize()
    row = tx.one("SELECT COUNT(*) AS n FROM jobs WHERE status = 'queued'")
    num_queued = int(row["n"]) if row else 0
    if num_queued + num_new > max_queued:
        raise QueueFull(f"{num_queued} jobs queued, limit {max_queued}")


def _select_page(tx: Tx, table: str, columns: str, *, limit: int, after: str | None,
                 equals: Mapping[str, str | None]) -> list[Row]:
    """Newest rows first, after the row with id `after`; `equals` filters on columns (None: no filter).
    `table`, `columns` and the keys of `equals` are constants of the caller, never request data."""
    _check_limit(limit)
    where = ["TRUE"]
    params: list[Any] = []
    for column, value in equals.items():
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if after is not None:
        where.append(f"num < (SELECT num FROM {table} WHERE id = ?)")
        params.append(after)
    sql = f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} ORDER BY num DESC LIMIT ?"
    return tx.all(sql, (*params, limit))


def _get_batch(tx: Tx, batch_id: str) -> Batch | None:
    row = tx.one("SELECT * FROM batches WHERE id = ?", (batch_id,))
    return None if row is None else _batch(row)


def _batch_changes(status: str | None, output_file_id: str | None, error_file_id: str | None,
                   request_counts: BatchRequestCounts | None,
                   errors: dict[str, Any] | None) -> tuple[list[str], list[Any]]:
    """SET clauses and their parameters for the fields that were given."""
    if status is not None:
        _check_one_of("batch status", status, BATCH_STATUSES)
    given: dict[str, Any] = {"status": status, "output_file_id": output_file_id, "error_file_id": error_file_id,
                             "errors": _dumps(errors)}
    if request_counts is not None:
        given |= dataclasses.asdict(request_counts)  # the total, completed and failed columns
    changes = {column: value for column, value in given.items() if value is not None}
    assignments = [f"{column} = ?" for column in changes]
    if status is not None and status != "validating":
        # stamped the first time the batch reaches the status, as OpenAI does
        assignments.append(f"{status}_at = COALESCE({status}_at, {{now}})")
    return assignments, list(changes.values())


# -- checks and conversions --------------------------------------------------------------------------------
def _check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")


def _check_one_of(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}; got {value!r}")


def _check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise ValueError(f"lease_s must be positive, got {lease_s}")


def _storable(text: str) -> str:
    # PostgreSQL text cannot hold NUL; replaced on every backend so both store the same output
    return text.replace("\x00", "\ufffd")


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _job(row: Row) -> Job:
    return Job(id=row["id"], kind=row["kind"], request=json.loads(row["request"]), status=row["status"],
               created_at=row["created_at"], started_at=row["started_at"], finished_at=row["finished_at"],
               progress_tokens=row["progress_tokens"], text=row["text"], result=_loads(row["result"]),
               error=row["error"], worker_id=row["worker_id"], lease_expires_at=row["lease_expires_at"],
               attempts=row["attempts"], cancel_requested=bool(row["cancel_requested"]), batch_id=row["batch_id"],
               custom_id=row["custom_id"])


def _file(row: Row) -> FileObject:
    return FileObject(id=row["id"], bytes=row["bytes"], created_at=int(row["created_at"]), filename=row["filename"],
                      purpose=row["purpose"])


def _batch(row: Row) -> Batch:
    return Batch(
        id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"],
        completion_window=row["completion_window"], status=row["status"], created_at=int(row["created_at"]),
        expires_at=int(row["expires_at"]), output_file_id=row["output_file_id"], error_file_id=row["error_file_id"],
        errors=_loads(row["errors"]), in_progress_at=_seconds(row["in_progress_at"]),
        finalizing_at=_seconds(row["finalizing_at"]), completed_at=_seconds(row["completed_at"]),
        failed_at=_seconds(row["failed_at"]), expired_at=_seconds(row["expired_at"]),
        cancelling_at=_seconds(row["cancelling_at"]), cancelled_at=_seconds(row["cancelled_at"]),
        request_counts=BatchRequestCounts(row["total"], row["completed"], row["failed"]),
        metadata=_loads(row["metadata"]))


def _seconds(value: float | None) -> int | None:
    # OpenAI's Batch timestamps are whole unix seconds
    return None if value is None else int(value)
