"""The job store's boundary objects: jobs, their output chunks, and the files and batches of the OpenAI
Batch API, as frozen dataclasses (the store's rows, typed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from service.openai.kinds import KINDS, Kind

JobKind = Kind  # a job is a completion or a chat request
JOB_KINDS = KINDS
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
FINISHED_JOB_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
BATCH_STATUSES: tuple[str, ...] = get_args(BatchStatus)
FINISHED_BATCH_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class QueueFull(Exception):
    """Raised by `create` when the queue already holds `max_queued` jobs."""


@dataclass(frozen=True)
class NewJob:
    kind: JobKind
    request: dict[str, Any]
    batch_id: str | None = None
    custom_id: str | None = None


@dataclass(frozen=True)
class Job:
    id: str  # "job_<hex>"
    kind: JobKind
    request: dict[str, Any]  # the original request body, exactly as sent
    status: JobStatus
    created_at: float  # unix seconds, database clock
    started_at: float | None  # first claim
    finished_at: float | None
    progress_tokens: int  # generated tokens persisted so far
    text: str  # generated text persisted so far
    result: dict[str, Any] | None
    error: str | None
    worker_id: str | None  # the current (or last) owner
    lease_expires_at: float | None  # unix seconds, database clock; None unless running
    attempts: int  # number of claims
    cancel_requested: bool
    batch_id: str | None
    custom_id: str | None

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_JOB_STATUSES


@dataclass(frozen=True)
class JobEvent:
    seq: int  # starts at 1 per job, gap-free across attempts
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class FileObject:
    """OpenAI File object (without its content)."""

    id: str  # "file-<hex>"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"


@dataclass(frozen=True)
class BatchRequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class Batch:
    """OpenAI Batch object; `dataclasses.asdict` gives its JSON form."""

    id: str  # "batch_<hex>"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None
    object: str = "batch"
