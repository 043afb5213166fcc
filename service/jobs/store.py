"""Durable generation jobs and OpenAI Batch storage: the boundary types and the store contract.

Every method is synchronous and thread-safe; the asyncio layers call them through `asyncio.to_thread`.
When a state-changing method returns, the change is committed: a process crash loses nothing.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, get_args

JobKind = Literal["completion", "chat"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_KINDS: tuple[str, ...] = get_args(JobKind)
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


class JobStore(ABC):
    """Jobs, their streamed output, and the files and batches of the OpenAI Batch API."""

    # -- jobs ------------------------------------------------------------------------------------------

    def create(
        self,
        kind: JobKind,
        request: dict[str, Any],
        *,
        batch_id: str | None = None,
        custom_id: str | None = None,
        max_queued: int | None = None,
    ) -> Job:
        """Queue one job. Raises QueueFull when `max_queued` jobs are already queued."""
        new_job = NewJob(kind=kind, request=request, batch_id=batch_id, custom_id=custom_id)
        return self.create_many([new_job], max_queued=max_queued)[0]

    @abstractmethod
    def create_many(self, new_jobs: Sequence[NewJob], *, max_queued: int | None = None) -> builtins.list[Job]:
        """Queue all jobs in one transaction, in order; QueueFull (and nothing queued) if they don't fit."""

    @abstractmethod
    def get(self, job_id: str) -> Job | None: ...

    @abstractmethod
    def list(self, *, limit: int = 20, after: str | None = None, status: str | None = None) -> builtins.list[Job]:
        """Newest first; `after` is the id of the last job of the previous page."""

    @abstractmethod
    def list_batch_jobs(self, batch_id: str) -> builtins.list[Job]:
        """A batch's jobs in the order they were created."""

    @abstractmethod
    def cancel(self, job_id: str) -> Job | None:
        """Queued: cancelled at once. Running: `cancel_requested`, the owner finishes it as cancelled.
        Finished: unchanged. None when the job does not exist."""

    @abstractmethod
    def claim(self, worker_id: str, lease_s: float, *, max_attempts: int | None = None) -> Job | None:
        """Take the oldest queued job, or a running one whose lease expired, for `lease_s` seconds.

        Expired jobs that had a cancel requested are finished as cancelled instead of re-run, and with
        `max_attempts` an expired job already claimed that many times is finished as failed.
        NOTE: `worker_id` names one owner; two runners must not share it.
        """

    @abstractmethod
    def renew(self, job_id: str, worker_id: str, lease_s: float) -> bool:
        """Extend the lease to `lease_s` from now; False when `worker_id` no longer owns the job."""

    @abstractmethod
    def append(self, job_id: str, worker_id: str, text: str, token_ids: Sequence[int]) -> int | None:
        """Persist one chunk of output (event row and job text in one transaction).
        Returns the chunk's seq, or None when `worker_id` no longer owns the job.
        NUL characters (which PostgreSQL text cannot hold) are stored as U+FFFD on every backend."""

    @abstractmethod
    def events(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> builtins.list[JobEvent]:
        """Chunks with seq > `after_seq`, in order."""

    @abstractmethod
    def finish(
        self,
        job_id: str,
        worker_id: str,
        status: JobStatus,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> bool:
        """Only the current owner can finish a running job; False otherwise. A finished job never changes."""

    @abstractmethod
    def counts(self) -> dict[str, int]:
        """Number of jobs in every status (zeros included)."""

    # -- files -----------------------------------------------------------------------------------------

    @abstractmethod
    def create_file(self, purpose: str, filename: str, data: bytes) -> FileObject: ...

    @abstractmethod
    def get_file(self, file_id: str) -> FileObject | None: ...

    @abstractmethod
    def file_content(self, file_id: str) -> bytes | None: ...

    @abstractmethod
    def list_files(
        self, *, purpose: str | None = None, limit: int = 100, after: str | None = None
    ) -> builtins.list[FileObject]:
        """Newest first; `after` is the id of the last file of the previous page."""

    @abstractmethod
    def delete_file(self, file_id: str) -> bool: ...

    # -- batches ---------------------------------------------------------------------------------------

    @abstractmethod
    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        """A new batch in status "validating"; `completion_window` is "<hours>h"."""

    @abstractmethod
    def get_batch(self, batch_id: str) -> Batch | None: ...

    @abstractmethod
    def list_batches(self, *, limit: int = 20, after: str | None = None) -> builtins.list[Batch]:
        """Newest first; `after` is the id of the last batch of the previous page."""

    @abstractmethod
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
        """Set the given fields; a new status also stamps its `<status>_at` time.
        A finished batch (failed, completed, expired, cancelled) is returned unchanged."""

    @abstractmethod
    def cancel_batch(self, batch_id: str) -> Batch | None:
        """validating/in_progress -> cancelling, and the batch's jobs are cancelled as by `cancel`.
        The batch runner moves it to cancelled once its running jobs have stopped."""

    # -- lifetime --------------------------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> JobStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_store(url: str) -> JobStore:
    """`sqlite:///abs/path.db`, `sqlite:///:memory:`, or `postgresql://user@host:port/db` (`postgres://`)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"job store url {url!r} has no scheme; use sqlite:///path or postgresql://...")
    if scheme == "sqlite":
        from service.jobs.sqlite import SqliteJobStore

        return SqliteJobStore(_sqlite_path(rest))
    if scheme in ("postgresql", "postgres"):
        from service.jobs.postgres import PostgresJobStore

        return PostgresJobStore(url)
    raise ValueError(f"unknown job store scheme {scheme!r}; use sqlite:///path or postgresql://...")


def _sqlite_path(rest: str) -> str:
    if rest == "/:memory:":
        return ":memory:"
    if not rest.startswith("/") or rest == "/":
        raise ValueError(f"sqlite job store needs an absolute path (sqlite:///abs/path.db), got {rest!r}")
    return rest
