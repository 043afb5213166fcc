"""The job worker of one server process: claims jobs from the shared store with a lease and runs up to
`concurrency` of them through the AsyncEngine at once (see `run.py` for one job's life).

Every process has its own worker id, so after a crash its jobs are reclaimed only once their leases
expire, by whichever replica claims first; `finish` succeeds only for the current owner, so a job never
completes twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable

from service.jobs.records import Job
from service.jobs.run import JobRun, WorkerOptions
from service.jobs.store import JobStore
from service.state import ServerState

log = logging.getLogger(__name__)

CLAIM_GRACE_S = 5.0  # a claim in flight when the worker stops; past that, the loop waits for a slot


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class JobWorker:
    def __init__(self, store: JobStore, state: ServerState, options: WorkerOptions,
                 on_persisted: Callable[[str], None], on_finished: Callable[[Job], None]) -> None:
        self.store, self.state, self.options = store, state, options
        self.worker_id = new_worker_id()
        self.runs: dict[str, JobRun] = {}  # job id -> its run in this process
        self._on_persisted, self._on_finished = on_persisted, on_finished
        self._is_claiming = True
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(options.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._claimer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._claimer = asyncio.create_task(self._claim_loop(), name="moecache-job-claims")
        log.info("job worker %s: up to %d jobs at once", self.worker_id, self.options.concurrency)

    def wake(self) -> None:
        """A job was queued here: claim now instead of at the next poll."""
        self._wakeup.set()

    def cancel(self, job_id: str) -> None:
        """Stop a job this process runs (its cancel is already requested in the store)."""
        if (run := self.runs.get(job_id)) is not None:
            run.stop(cancelled=True)

    def stop_claiming(self) -> None:
        self._is_claiming = False
        self._wakeup.set()

    async def stop(self, timeout: float) -> None:
        """Stop claiming and wait for the runs to end (the engine's drain ends their generation); runs
        still going after `timeout` are aborted and resume on the next claim."""
        self.stop_claiming()
        if self._claimer is not None and not await _wait({self._claimer}, CLAIM_GRACE_S):
            self._claimer.cancel()  # waiting for a free slot, not inside a claim
        if not await _wait(self._tasks, timeout):
            for run in self.runs.values():
                run.stop(cancelled=False)
            await _wait(self._tasks, timeout)

    async def _claim_loop(self) -> None:
        while self._is_claiming:
            await self._slots.acquire()
            self._wakeup.clear()  # before claiming, so a job queued meanwhile is not missed
            job = await self._claim()
            if job is None:
                self._slots.release()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.options.poll_s)
                continue
            self._spawn(job)

    async def _claim(self) -> Job | None:
        if not (self._is_claiming and self.state.engine.is_accepting):
            return None
        try:
            return await asyncio.to_thread(self.store.claim, self.worker_id, self.options.lease_s,
                                           max_attempts=self.options.max_attempts)
        except Exception:  # the store is unreachable: try again at the next poll
            log.exception("claiming a job failed")
            return None

    def _spawn(self, job: Job) -> None:
        log.info("job %s: claimed (attempt %d, %d tokens persisted)", job.id, job.attempts, job.progress_tokens)
        run = JobRun(job, self.worker_id, self.store, self.state, self.options, self._on_persisted,
                     self._on_finished)
        self.runs[job.id] = run
        task = asyncio.create_task(run.run(), name=f"moecache-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(job.id, done))

    def _ended(self, job_id: str, task: asyncio.Task[None]) -> None:
        self.runs.pop(job_id, None)
        self._tasks.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("job %s: the run failed; it resumes on the next claim", job_id, exc_info=task.exception())


async def _wait(tasks: set[asyncio.Task[None]], timeout: float) -> bool:
    """Wait for the tasks; False when some are still running after `timeout` seconds."""
    if not tasks:
        return True
    _, pending = await asyncio.wait(set(tasks), timeout=timeout)
    return not pending
