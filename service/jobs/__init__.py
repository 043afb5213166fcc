"""Durable generation jobs (SQLite on one box, PostgreSQL shared by replicas) and the files and
batches of the OpenAI Batch API. Open a store with `open_store(url)`."""

from service.jobs.records import (
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
    NewJob,
    QueueFull,
)
from service.jobs.store import JobStore, open_store

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
