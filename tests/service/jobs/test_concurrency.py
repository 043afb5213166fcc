"""Many workers on one queue: every job completes exactly once, none is lost, no two live owners."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from service.jobs import JobStore, QueueFull, open_store

NUM_JOBS = 50
NUM_THREADS = 4
NUM_PROCESSES = 2
MAX_QUEUED = 15
FILL_ROUNDS = 4
LONG_LEASE_S = 30.0
SHORT_LEASE_S = 0.2
STORE_PROCESS = Path(__file__).with_name("store_process.py")


class Ledger:
    """What the workers did, checked after they are done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: set[str] = set()
        self.double_owned: list[str] = []
        self.finishes: Counter[str] = Counter()  # successful finishes per job
        self.stale_finishes: list[bool] = []

    def claimed(self, job_id: str) -> None:
        with self._lock:
            if job_id in self.live:
                self.double_owned.append(job_id)
            self.live.add(job_id)

    def finished(self, job_id: str, ok: bool) -> None:
        with self._lock:
            self.live.discard(job_id)
            self.finishes[job_id] += ok

    def stale(self, results: list[bool]) -> None:
        with self._lock:
            self.stale_finishes += results


def _fill(url: str) -> set[str]:
    with open_store(url) as store:
        return {store.create("completion", {"prompt": f"p{i}"}).id for i in range(NUM_JOBS)}


def _run_threads(target: Callable[[int, threading.Barrier], None]) -> None:
    """Run target(i, start) in NUM_THREADS threads; `start` lines them up. Re-raises a thread's error."""
    start = threading.Barrier(NUM_THREADS, timeout=30)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i, start)
        except BaseException as exc:
            errors.append(exc)
            start.abort()  # the others must not wait for a thread that is gone

    # daemon: a thread stuck by a broken store fails the test instead of hanging the interpreter's exit
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads)


def _drain(store: JobStore, worker_id: str, ledger: Ledger, start: threading.Barrier) -> None:
    start.wait()
    while (job := store.claim(worker_id, LONG_LEASE_S)) is not None:
        ledger.claimed(job.id)
        store.append(job.id, worker_id, "x", [1])
        ledger.finished(job.id, store.finish(job.id, worker_id, "succeeded"))


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_threads_complete_every_job_exactly_once(store_url: str, shared: bool) -> None:
    job_ids = _fill(store_url)
    ledger = Ledger()
    stores = [open_store(store_url)] * NUM_THREADS if shared else [open_store(store_url) for _ in range(NUM_THREADS)]

    _run_threads(lambda i, start: _drain(stores[i], f"w{i}", ledger, start))

    assert ledger.double_owned == []
    assert ledger.finishes == Counter({job_id: 1 for job_id in job_ids})
    for store in set(stores):
        store.close()
    with open_store(store_url) as store:
        assert store.counts()["succeeded"] == NUM_JOBS
        assert {job.attempts for job in store.list(limit=NUM_JOBS)} == {1}


def _abandons(job_id: str) -> bool:
    # about a quarter of first attempts die: the worker walks away without finishing or renewing
    return int(job_id[-2:], 16) % 4 == 0


def _work_and_die(store: JobStore, worker_id: str, ledger: Ledger, start: threading.Barrier) -> None:
    abandoned: list[str] = []
    start.wait()
    while store.counts()["succeeded"] < NUM_JOBS:
        job = store.claim(worker_id, SHORT_LEASE_S)
        if job is None:
            time.sleep(0.02)
        elif job.attempts == 1 and _abandons(job.id):
            abandoned.append(job.id)
        else:
            ledger.finished(job.id, store.finish(job.id, worker_id, "succeeded"))
    # the dead owners come back after their jobs were reclaimed and completed by someone else
    ledger.stale([store.finish(job_id, worker_id, "failed") for job_id in abandoned])


def test_jobs_of_dead_workers_are_reclaimed_and_completed_once(store_url: str) -> None:
    job_ids = _fill(store_url)
    ledger = Ledger()

    with open_store(store_url) as store:
        _run_threads(lambda i, start: _work_and_die(store, f"w{i}", ledger, start))
        jobs = store.list(limit=NUM_JOBS)

    assert ledger.finishes == Counter({job_id: 1 for job_id in job_ids})
    assert ledger.stale_finishes and not any(ledger.stale_finishes)
    assert {job.status for job in jobs} == {"succeeded"}
    # at least 2: under load a second owner's lease can lapse too, and the job is claimed once more
    assert all(job.attempts >= 2 for job in jobs if _abandons(job.id))


def test_processes_complete_every_job_exactly_once(store_url: str) -> None:
    job_ids = _fill(store_url)
    command = [sys.executable, str(STORE_PROCESS), "worker", store_url]
    workers = [
        subprocess.Popen([*command, f"p{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(NUM_PROCESSES)
    ]
    for worker in workers:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    outputs = [worker.communicate(timeout=60)[0] for worker in workers]

    assert [worker.returncode for worker in workers] == [0] * NUM_PROCESSES
    lines = [json.loads(line) for output in outputs for line in output.splitlines()]
    assert all(line["finished"] for line in lines)
    assert Counter(line["job_id"] for line in lines) == Counter({job_id: 1 for job_id in job_ids})
    with open_store(store_url) as store:
        assert store.counts()["succeeded"] == NUM_JOBS


def _fill_rounds(url: str, outcomes: list[str], start: threading.Barrier) -> None:
    with open_store(url) as store:
        for _ in range(FILL_ROUNDS):
            start.wait()
            for i in range(10):
                try:
                    store.create("completion", {"i": i}, max_queued=MAX_QUEUED)
                    outcomes.append("created")
                except QueueFull:
                    outcomes.append("full")
            # one thread empties the queue, so every round races for the last places again
            if start.wait() == 0:
                for job in store.list(status="queued", limit=MAX_QUEUED + NUM_THREADS):
                    store.cancel(job.id)


def test_concurrent_creates_never_overfill_the_queue(store_url: str) -> None:
    open_store(store_url).close()  # migrated up front: this is about the queue limit alone
    outcomes: list[str] = []

    _run_threads(lambda i, start: _fill_rounds(store_url, outcomes, start))

    num_created = FILL_ROUNDS * MAX_QUEUED
    assert Counter(outcomes) == {"created": num_created, "full": FILL_ROUNDS * NUM_THREADS * 10 - num_created}


def _open_and_create(url: str, created: list[str], start: threading.Barrier) -> None:
    start.wait()
    with open_store(url) as store:
        created.append(store.create("chat", {}).id)


def test_concurrent_first_opens_create_the_schema_once(store_url: str) -> None:
    created: list[str] = []

    _run_threads(lambda i, start: _open_and_create(store_url, created, start))

    with open_store(store_url) as store:
        assert sorted(job.id for job in store.list(limit=NUM_THREADS + 1)) == sorted(created)
        assert len(created) == NUM_THREADS
