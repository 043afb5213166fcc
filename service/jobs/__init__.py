"""Durable generation jobs (SQLite on one box, PostgreSQL shared by replicas) and the files and
batches of the OpenAI Batch API. Open one with `open_store(url)`."""

from service.jobs.store import (
    BATCH_STATUSES,
    FINISHED_BATCH_STATUSES,
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
    JobStore,
    NewJob,
    QueueFull,
    open_store,
)

__all__ = [
    "BATCH_STATUSES",
    "FINISHED_BATCH_STATUSES",
    "FINISHED_JOB_STATUSES",
    "JOB_KINDS",
    "JOB_STATUSES",
    "Batch",
    "BatchRequestCounts",
    "BatchStatus",
    "FileObject",
    "Job",
    "JobEvent",
    "JobKind",
    "JobStatus",
    "JobStore",
    "NewJob",
    "QueueFull",
    "open_store",
]
