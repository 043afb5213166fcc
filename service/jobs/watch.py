"""Following a job's output as it is persisted: the store is the source of truth (the job may run on
another replica); a worker in this process wakes the watchers of its jobs so they need not wait for
the next poll."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from service.jobs.records import Job, JobEvent
from service.jobs.store import JobStore

EVENTS_PER_READ = 256


class JobSignals:
    """One asyncio.Event per watcher, set when this process persisted output of the watched job."""

    def __init__(self) -> None:
        self._listeners: dict[str, set[asyncio.Event]] = {}
        self.is_closed = False

    def notify(self, job_id: str) -> None:
        for event in self._listeners.get(job_id, ()):
            event.set()

    def close(self) -> None:
        """The server drains: every watch ends now (its client resumes elsewhere from its last chunk)."""
        self.is_closed = True
        for listeners in self._listeners.values():
            for event in listeners:
                event.set()

    @contextlib.contextmanager
    def listen(self, job_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._listeners.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            listeners = self._listeners[job_id]
            listeners.discard(event)
            if not listeners:
                del self._listeners[job_id]


async def watch_job(store: JobStore, signals: JobSignals, job_id: str, after_seq: int,
                    poll_s: float) -> AsyncIterator[JobEvent | Job]:
    """The job's chunks after `after_seq`, in order, then the finished job. Ends early, without the
    job, when the job disappears from the store or the server drains."""
    with signals.listen(job_id) as changed:
        while not signals.is_closed:
            changed.clear()
            # NOTE: the job is read before its events: once it reads finished, every chunk is stored.
            job = await asyncio.to_thread(store.get, job_id)
            if job is None:
                return
            events = await asyncio.to_thread(store.events, job_id, after_seq, EVENTS_PER_READ)
            for event in events:
                yield event
                after_seq = event.seq
            if len(events) == EVENTS_PER_READ:
                continue
            if job.is_finished:
                yield job
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), poll_s)
