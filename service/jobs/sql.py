"""The job store over any `Database`: the queue, leases and streamed output, written once for both
SQLite and PostgreSQL. Ownership of a running job is `worker_id` on its row; every write by a worker
checks it in the same statement, so a worker that lost its lease cannot touch the job again."""

from __future__ import annotations

import builtins
import json
from collections.abc import Sequence
from typing import Any

from service.jobs.db import Database, Tx, migrate
from service.jobs.queries import CANCEL_JOBS_WHERE, check_limit, check_one_of, select_page
from service.jobs.rows import dumps, event_from_row, job_from_row, new_id
from service.jobs.schema import MIGRATIONS
from service.jobs.sql_batches import SqlBatches
from service.jobs.store import (
    FINISHED_JOB_STATUSES,
    JOB_KINDS,
    JOB_STATUSES,
    Job,
    JobEvent,
    JobStatus,
    JobStore,
    NewJob,
    QueueFull,
)

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


class SqlJobStore(SqlBatches, JobStore):
    def __init__(self, db: Database) -> None:
        self._db = db
        migrate(db, MIGRATIONS)

    def create_many(self, new_jobs: Sequence[NewJob], *, max_queued: int | None = None) -> builtins.list[Job]:
        for new_job in new_jobs:
            check_one_of("kind", new_job.kind, JOB_KINDS)
        with self._db.transaction() as tx:
            if max_queued is not None:
                _check_room(tx, len(new_jobs), max_queued)
            return [_insert_job(tx, new_job) for new_job in new_jobs]

    def get(self, job_id: str) -> Job | None:
        with self._db.transaction(write=False) as tx:
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else job_from_row(row)

    def list(self, *, limit: int = 20, after: str | None = None, status: str | None = None) -> builtins.list[Job]:
        if status is not None:
            check_one_of("status", status, JOB_STATUSES)
        with self._db.transaction(write=False) as tx:
            rows = select_page(tx, "jobs", "*", limit=limit, after=after, equals={"status": status})
        return [job_from_row(row) for row in rows]

    def list_batch_jobs(self, batch_id: str) -> builtins.list[Job]:
        with self._db.transaction(write=False) as tx:
            rows = tx.all("SELECT * FROM jobs WHERE batch_id = ? ORDER BY num", (batch_id,))
        return [job_from_row(row) for row in rows]

    def cancel(self, job_id: str) -> Job | None:
        with self._db.transaction() as tx:
            tx.run(CANCEL_JOBS_WHERE + "id = ?", (job_id,))
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else job_from_row(row)

    def claim(self, worker_id: str, lease_s: float, *, max_attempts: int | None = None) -> Job | None:
        _check_lease(lease_s)
        with self._db.transaction() as tx:
            tx.run(_CANCEL_EXPIRED)
            if max_attempts is not None:
                tx.run(_FAIL_EXPIRED, (f"the job's worker was lost {max_attempts} times", max_attempts))
            row = tx.one(_CLAIM, (worker_id, lease_s))
        return None if row is None else job_from_row(row)

    def renew(self, job_id: str, worker_id: str, lease_s: float) -> bool:
        _check_lease(lease_s)
        with self._db.transaction() as tx:
            return tx.run(_RENEW, (lease_s, job_id, worker_id)) == 1

    def append(self, job_id: str, worker_id: str, text: str, token_ids: Sequence[int]) -> int | None:
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
        sql = "SELECT seq, text, token_ids FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq"
        params: builtins.list[Any] = [job_id, after_seq]
        if limit is not None:
            check_limit(limit)
            sql += " LIMIT ?"
            params.append(limit)
        with self._db.transaction(write=False) as tx:
            return [event_from_row(row) for row in tx.all(sql, params)]

    def finish(
        self,
        job_id: str,
        worker_id: str,
        status: JobStatus,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> bool:
        check_one_of("finish status", status, tuple(FINISHED_JOB_STATUSES))
        with self._db.transaction() as tx:
            params = (status, dumps(result), None if error is None else _storable(error), job_id, worker_id)
            return tx.run(_FINISH, params) == 1

    def counts(self) -> dict[str, int]:
        with self._db.transaction(write=False) as tx:
            rows = tx.all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        found = {row["status"]: int(row["n"]) for row in rows}
        return {status: found.get(status, 0) for status in JOB_STATUSES}

    def close(self) -> None:
        self._db.close()


def _insert_job(tx: Tx, new_job: NewJob) -> Job:
    params = (new_id("job_"), new_job.kind, json.dumps(new_job.request), new_job.batch_id, new_job.custom_id)
    row = tx.one(_INSERT_JOB, params)
    assert row is not None  # INSERT ... RETURNING always yields its row
    return job_from_row(row)


def _check_room(tx: Tx, num_new: int, max_queued: int) -> None:
    # NOTE: serialized, so two concurrent creates cannot both see the last free place
    tx.serialize()
    row = tx.one("SELECT COUNT(*) AS n FROM jobs WHERE status = 'queued'")
    num_queued = int(row["n"]) if row else 0
    if num_queued + num_new > max_queued:
        raise QueueFull(f"{num_queued} jobs queued, limit {max_queued}")


def _storable(text: str) -> str:
    # PostgreSQL text cannot hold NUL; replaced on every backend so both store the same output
    return text.replace("\x00", "\ufffd")


def _check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise ValueError(f"lease_s must be positive, got {lease_s}")
