"""Database rows to boundary objects."""

from __future__ import annotations

import json
import uuid
from typing import Any

from service.jobs.db import Row
from service.jobs.store import Batch, BatchRequestCounts, FileObject, Job, JobEvent

FILE_COLUMNS = "id, purpose, filename, bytes, created_at"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def job_from_row(row: Row) -> Job:
    return Job(
        id=row["id"],
        kind=row["kind"],
        request=json.loads(row["request"]),
        status=row["status"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        progress_tokens=row["progress_tokens"],
        text=row["text"],
        result=loads(row["result"]),
        error=row["error"],
        worker_id=row["worker_id"],
        lease_expires_at=row["lease_expires_at"],
        attempts=row["attempts"],
        cancel_requested=bool(row["cancel_requested"]),
        batch_id=row["batch_id"],
        custom_id=row["custom_id"],
    )


def event_from_row(row: Row) -> JobEvent:
    return JobEvent(seq=row["seq"], text=row["text"], token_ids=tuple(json.loads(row["token_ids"])))


def file_from_row(row: Row) -> FileObject:
    return FileObject(
        id=row["id"],
        bytes=row["bytes"],
        created_at=int(row["created_at"]),
        filename=row["filename"],
        purpose=row["purpose"],
    )


def batch_from_row(row: Row) -> Batch:
    return Batch(
        id=row["id"],
        endpoint=row["endpoint"],
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        created_at=int(row["created_at"]),
        expires_at=int(row["expires_at"]),
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        errors=loads(row["errors"]),
        in_progress_at=_seconds(row["in_progress_at"]),
        finalizing_at=_seconds(row["finalizing_at"]),
        completed_at=_seconds(row["completed_at"]),
        failed_at=_seconds(row["failed_at"]),
        expired_at=_seconds(row["expired_at"]),
        cancelling_at=_seconds(row["cancelling_at"]),
        cancelled_at=_seconds(row["cancelled_at"]),
        request_counts=BatchRequestCounts(row["total"], row["completed"], row["failed"]),
        metadata=loads(row["metadata"]),
    )


def _seconds(value: float | None) -> int | None:
    # OpenAI's Batch timestamps are whole unix seconds
    return None if value is None else int(value)
