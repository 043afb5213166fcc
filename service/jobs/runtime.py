"""The jobs side of one server: the store, the worker that runs jobs, the batch runner, and the
operations the HTTP and gRPC APIs share (submit, cancel, list, watch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.jobs.api import check_after, check_job, check_page, is_id, not_found
from service.jobs.batches import BatchRunner
from service.jobs.records import Batch, Job, JobEvent, JobKind, QueueFull
from service.jobs.run import WorkerOptions
from service.jobs.store import JobStore, open_store
from service.jobs.watch import JobSignals, watch_job
from service.jobs.worker import JobWorker
from service.openai.errors import ApiError
from service.openai.kinds import request_kind
from service.state import ServerState

log = logging.getLogger(__name__)


def default_jobs_db() -> str:
    """sqlite:///<MOECACHE_CACHE_DIR or ~/.cache/moecache>/jobs.db"""
    cache_dir = os.environ.get("MOECACHE_CACHE_DIR") or str(Path.home() / ".cache" / "moecache")
    return f"sqlite:///{Path(cache_dir).resolve() / 'jobs.db'}"


@dataclass(frozen=True)
class JobOptions:
    db_url: str = field(metadata={
        "flag": "--jobs-db", "metavar": "URL", "help": "job store: sqlite:///PATH, or postgresql://... shared by "
        "several replicas (default: sqlite:///<MOECACHE_CACHE_DIR or ~/.cache/moecache>/jobs.db)"})
    worker: WorkerOptions = WorkerOptions()
    max_queued_jobs: int = field(default=10_000, metadata={
        "flag": "--max-queued-jobs", "metavar": "N", "help": "more submissions get 429"})
    max_file_bytes: int = field(default=200 << 20, metadata={
        "flag": "--max-file-bytes", "metavar": "N", "help": "larger uploads get 413"})
    batch_poll_s: float = 10.0  # how often unfinished batches are checked for what a crash left behind

    def __post_init__(self) -> None:
        if self.max_queued_jobs < 1 or self.max_file_bytes < 1:
            raise ValueError("max_queued_jobs and max_file_bytes must be at least 1")


class Jobs:
    def __init__(self, options: JobOptions, state: ServerState) -> None:
        self.options, self.state = options, state
        self.signals = JobSignals()
        self._store: JobStore | None = None
        self._worker: JobWorker | None = None
        self._batches: BatchRunner | None = None
        self._scanner: asyncio.Task[None] | None = None

    @property
    def store(self) -> JobStore:
        assert self._store is not None, "the job store is not open"
        return self._store

    @property
    def batches(self) -> BatchRunner:
        assert self._batches is not None, "the job store is not open"
        return self._batches

    # -- lifecycle --------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Open (and migrate) the store; before the model loads, so a bad URL fails fast."""
        url = self.options.db_url
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite://")).parent.mkdir(parents=True, exist_ok=True)
        self._store = await asyncio.to_thread(open_store, url)
        self._batches = BatchRunner(self._store, self._validate, self.options.max_queued_jobs,
                                    self.options.batch_poll_s)
        self.state.metrics.watch_jobs(self._store.counts)

    def start(self) -> None:
        """Start claiming jobs and scanning batches (the engine is ready)."""
        self._worker = JobWorker(self.store, self.state, self.options.worker, self.signals.notify, self._finished)
        self._worker.start()
        self._scanner = asyncio.create_task(self.batches.run(), name="moecache-batches")

    def stop_claiming(self) -> None:
        """The server drains: claim nothing more and end the watches."""
        self.signals.close()
        if self._worker is not None:
            self._worker.stop_claiming()

    async def stop(self, timeout: float) -> None:
        """Wait for the runs to end (the engine drained them), then close the store."""
        if self._scanner is not None:
            self._scanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scanner
        if self._worker is not None:
            await self._worker.stop(timeout)
        if self._batches is not None:
            await self._batches.wait_idle()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)

    def wake_worker(self) -> None:
        """Jobs were queued in this process: claim them now rather than at the next poll."""
        if self._worker is not None:
            self._worker.wake()

    # -- what the worker reports ------------------------------------------------------------------------
    def _finished(self, job: Job) -> None:
        if job.finished_at is not None:
            self.state.metrics.observe_job(job.finished_at - job.created_at)
        self.signals.notify(job.id)
        if job.batch_id is not None:
            self.batches.poke(job.batch_id)

    def _validate(self, kind: JobKind, body: dict[str, Any]) -> None:
        check_job(kind, body, self.state.model)

    # -- the API ----------------------------------------------------------------------------------------
    async def submit(self, body: dict[str, Any]) -> Job:
        kind = request_kind(body)
        await asyncio.to_thread(check_job, kind, body, self.state.model)
        try:
            job = await asyncio.to_thread(self.store.create, kind, body, max_queued=self.options.max_queued_jobs)
        except QueueFull as error:
            raise ApiError(429, f"too many queued jobs ({error}); retry later", code="too_many_jobs") from None
        self.wake_worker()
        return job

    async def get(self, job_id: str) -> Job:
        if not is_id(job_id):
            raise not_found(job_id)
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None:
            raise not_found(job_id)
        return job

    async def cancel(self, job_id: str) -> Job:
        if not is_id(job_id):
            raise not_found(job_id)
        job = await asyncio.to_thread(self.store.cancel, job_id)
        if job is None:
            raise not_found(job_id)
        if self._worker is not None:
            self._worker.cancel(job_id)
        return job

    async def list(self, limit: int, after: str | None, status: str | None) -> tuple[list[Job], bool]:
        """One page, newest first, and whether more follow."""
        check_page(limit, after, status)
        jobs = await asyncio.to_thread(self.store.list, limit=limit + 1, after=after, status=status)
        return jobs[:limit], len(jobs) > limit

    async def watch(self, job_id: str, after_seq: int) -> AsyncIterator[JobEvent | Job]:
        """The job's chunks after `after_seq`, then the finished job; 404 for an unknown job."""
        check_after(after_seq, "after_seq")
        await self.get(job_id)
        async for item in watch_job(self.store, self.signals, job_id, after_seq, self.options.worker.poll_s):
            yield item

    async def cancel_batch(self, batch_id: str) -> Batch | None:
        batch = await asyncio.to_thread(self.batches.cancel, batch_id)
        if batch is not None and self._worker is not None:
            for run in list(self._worker.runs.values()):
                if run.job.batch_id == batch_id:
                    run.stop(cancelled=True)
        return batch
