"""The OpenAI Batch API over jobs. A batch's input file becomes jobs of the shared store; its progress,
its end and its output and error files follow from the state of those jobs, so any replica can advance
any batch: the worker that finishes a batch's job refreshes the batch at once, and a periodic scan
catches what a crashed replica left (a batch stuck validating or finalizing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from service.jobs.batch_files import (
    JsonObject,
    Validate,
    error_line,
    input_error_line,
    jsonl,
    output_line,
    parse_input,
)
from service.jobs.records import FINISHED_BATCH_STATUSES, Batch, BatchRequestCounts, BatchStatus, Job, QueueFull
from service.jobs.store import JobStore

log = logging.getLogger(__name__)

VALIDATION_GRACE_S = 60.0  # a batch validating for longer lost the replica that validated it
PAGE = 100


class BatchRunner:
    def __init__(self, store: JobStore, validate: Validate, max_queued: int, poll_s: float) -> None:
        self.store, self.validate, self.max_queued, self.poll_s = store, validate, max_queued, poll_s
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- synchronous (called through asyncio.to_thread) ------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None) -> Batch:
        """Create the batch and queue its jobs; bad lines are kept as errors for the error file."""
        data = self.store.file_content(input_file_id) or b""
        batch = self.store.create_batch(input_file_id, endpoint, completion_window, metadata)
        return self._validate(batch, data)

    def _validate(self, batch: Batch, data: bytes) -> Batch:
        parsed = parse_input(data, batch.endpoint, batch.id, self.validate)
        if parsed.num_requests == 0:
            return self._fail(batch, "empty_file", "the input file holds no requests")
        if not self.store.list_batch_jobs(batch.id):  # NOTE: a validation redone after a crash adds nothing
            try:
                self.store.create_many(parsed.jobs, max_queued=self.max_queued)
            except QueueFull as error:
                return self._fail(batch, "queue_full", f"the job queue is full: {error}")
        errors = {"object": "list", "data": list(parsed.errors)} if parsed.errors else None
        counts = BatchRequestCounts(parsed.num_requests, 0, len(parsed.errors))
        self.store.update_batch(batch.id, status="in_progress", errors=errors, request_counts=counts)
        return self.refresh(batch.id) or batch

    def _fail(self, batch: Batch, code: str, message: str) -> Batch:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        return self.store.update_batch(batch.id, status="failed", errors=errors) or batch

    def cancel(self, batch_id: str) -> Batch | None:
        if self.store.cancel_batch(batch_id) is None:
            return None
        return self.refresh(batch_id)

    def refresh(self, batch_id: str) -> Batch | None:
        """Update the batch's counts from its jobs; finalize it once every job finished."""
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.status in FINISHED_BATCH_STATUSES or batch.status == "validating":
            return batch
        jobs = self.store.list_batch_jobs(batch_id)
        if batch.status == "in_progress" and time.time() > batch.expires_at:
            jobs = self._cancel_unfinished(batch_id, jobs)
        counts = _counts(batch, jobs)
        if not all(job.is_finished for job in jobs):
            return self.store.update_batch(batch_id, request_counts=counts)
        return self._finalize(batch, jobs, counts)

    def _cancel_unfinished(self, batch_id: str, jobs: list[Job]) -> list[Job]:
        for job in jobs:
            if not job.is_finished:
                self.store.cancel(job.id)
        return self.store.list_batch_jobs(batch_id)

    def _finalize(self, batch: Batch, jobs: Sequence[Job], counts: BatchRequestCounts) -> Batch | None:
        status = _final_status(batch, jobs)
        if batch.status == "in_progress":
            self.store.update_batch(batch.id, status="finalizing", request_counts=counts)
        data = self.store.file_content(batch.input_file_id) or b""
        errors = [input_error_line(e, data) for e in _line_errors(batch)]
        errors += [error_line(job, status) for job in jobs if job.status != "succeeded"]
        output_id = self._write(batch.id, "output", [output_line(job) for job in jobs if job.status == "succeeded"])
        error_id = self._write(batch.id, "error", errors)
        final = self.store.update_batch(batch.id, status=status, output_file_id=output_id, error_file_id=error_id,
                                        request_counts=counts)
        self._discard_unused(final, output_id, error_id)
        return final

    def _write(self, batch_id: str, name: str, lines: list[JsonObject]) -> str | None:
        if not lines:
            return None
        return self.store.create_file("batch_output", f"{batch_id}_{name}.jsonl", jsonl(lines)).id

    def _discard_unused(self, final: Batch | None, *file_ids: str | None) -> None:
        """Another replica finalized the batch first: its files are the batch's, these are garbage."""
        kept = {final.output_file_id, final.error_file_id} if final else set()
        for file_id in file_ids:
            if file_id is not None and file_id not in kept:
                self.store.delete_file(file_id)

    def scan(self) -> None:
        """Advance every unfinished batch (what a crashed replica may have left half done)."""
        for batch in self._unfinished():
            try:
                if batch.status == "validating":
                    self._recover(batch)
                else:
                    self.refresh(batch.id)
            except Exception:
                log.exception("advancing batch %s failed", batch.id)

    def _unfinished(self) -> list[Batch]:
        found: list[Batch] = []
        after: str | None = None
        while True:
            page = self.store.list_batches(limit=PAGE, after=after)
            found += [b for b in page if b.status not in FINISHED_BATCH_STATUSES]
            if len(page) < PAGE:
                return found
            after = page[-1].id

    def _recover(self, batch: Batch) -> None:
        if time.time() - batch.created_at < VALIDATION_GRACE_S:
            return  # still being validated by the request that created it
        data = self.store.file_content(batch.input_file_id)
        if data is None:
            self._fail(batch, "missing_file", f"the input file {batch.input_file_id} was deleted")
        else:
            self._validate(batch, data)

    # -- asynchronous ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Scan every `poll_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await asyncio.to_thread(self.scan)
            except Exception:
                log.exception("scanning the batches failed")

    def poke(self, batch_id: str) -> None:
        """Refresh a batch soon (one of its jobs just finished in this process)."""
        task = asyncio.create_task(asyncio.to_thread(self.refresh, batch_id))
        self._tasks.add(task)
        task.add_done_callback(self._poked)

    def _poked(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("refreshing a batch failed", exc_info=task.exception())

    async def wait_idle(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks))


def _line_errors(batch: Batch) -> list[JsonObject]:
    data = (batch.errors or {}).get("data") or []
    return [e for e in data if e.get("line") is not None]


def _counts(batch: Batch, jobs: Sequence[Job]) -> BatchRequestCounts:
    num_bad_lines = len(_line_errors(batch))
    succeeded = sum(job.status == "succeeded" for job in jobs)
    unsuccessful = sum(job.status in ("failed", "cancelled") for job in jobs)
    return BatchRequestCounts(len(jobs) + num_bad_lines, succeeded, unsuccessful + num_bad_lines)


def _final_status(batch: Batch, jobs: Sequence[Job]) -> BatchStatus:
    if batch.cancelling_at is not None:
        return "cancelled"
    if time.time() > batch.expires_at and any(job.status == "cancelled" for job in jobs):
        return "expired"
    return "completed"
