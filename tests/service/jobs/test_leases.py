"""Ownership of running jobs: leases, renewal, expiry and reclaim, finishing only by the owner."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from service.jobs import Job, JobStore, open_store
from service.jobs.db import Tx

LONG_LEASE_S = 30.0
SHORT_LEASE_S = 0.2


def _claim_one(store: JobStore, worker_id: str, lease_s: float) -> Job:
    store.create("chat", {"messages": []})
    job = store.claim(worker_id, lease_s)
    assert job is not None
    return job


def _expire() -> None:
    time.sleep(SHORT_LEASE_S + 0.15)


def test_finish_by_owner_records_the_result(store: JobStore) -> None:
    job = _claim_one(store, "w1", LONG_LEASE_S)

    assert store.finish(job.id, "w1", "succeeded", result={"usage": {"completion_tokens": 3}})

    final = store.get(job.id)
    assert final is not None
    assert (final.status, final.result, final.error) == ("succeeded", {"usage": {"completion_tokens": 3}}, None)
    assert final.finished_at is not None and final.lease_expires_at is None


def test_finish_records_the_error_of_a_failed_job(store: JobStore) -> None:
    job = _claim_one(store, "w1", LONG_LEASE_S)

    assert store.finish(job.id, "w1", "failed", error="out of memory")

    final = store.get(job.id)
    assert final is not None and (final.status, final.error, final.result) == ("failed", "out of memory", None)


def test_only_the_owner_can_finish(store: JobStore) -> None:
    job = _claim_one(store, "w1", LONG_LEASE_S)

    assert not store.finish(job.id, "w2", "succeeded")
    assert store.append(job.id, "w2", "x", [1]) is None
    assert not store.renew(job.id, "w2", LONG_LEASE_S)
    still = store.get(job.id)
    assert still is not None and (still.status, still.text) == ("running", "")


def test_a_finished_job_never_changes_again(store: JobStore) -> None:
    job = _claim_one(store, "w1", LONG_LEASE_S)
    assert store.finish(job.id, "w1", "succeeded", result={"n": 1})
    finished = store.get(job.id)

    assert not store.finish(job.id, "w1", "failed", error="late")
    assert store.append(job.id, "w1", "late", [9]) is None
    assert not store.renew(job.id, "w1", LONG_LEASE_S)
    assert store.get(job.id) == finished


def test_finish_of_a_queued_job_is_refused(store: JobStore) -> None:
    job = store.create("completion", {})

    assert not store.finish(job.id, "w1", "succeeded")
    assert store.get(job.id) == job


def test_finish_rejects_a_status_that_is_not_final(store: JobStore) -> None:
    job = _claim_one(store, "w1", LONG_LEASE_S)
    with pytest.raises(ValueError, match="finish status"):
        store.finish(job.id, "w1", "queued")


def test_a_live_lease_is_not_reclaimed(store: JobStore) -> None:
    _claim_one(store, "w1", LONG_LEASE_S)

    assert store.claim("w2", LONG_LEASE_S) is None


def test_expired_lease_is_reclaimed_and_the_old_owner_is_locked_out(store: JobStore) -> None:
    job = _claim_one(store, "w1", SHORT_LEASE_S)
    assert store.append(job.id, "w1", "Hello", [1]) == 1
    _expire()

    reclaimed = store.claim("w2", LONG_LEASE_S)

    assert reclaimed is not None and reclaimed.id == job.id
    assert (reclaimed.worker_id, reclaimed.attempts, reclaimed.text) == ("w2", 2, "Hello")
    assert reclaimed.started_at == job.started_at
    assert store.append(job.id, "w1", " stale", [2]) is None
    assert not store.renew(job.id, "w1", LONG_LEASE_S)
    assert not store.finish(job.id, "w1", "succeeded")
    assert store.append(job.id, "w2", " world", [3]) == 2
    assert store.finish(job.id, "w2", "succeeded")
    final = store.get(job.id)
    assert final is not None and (final.status, final.text, final.worker_id) == ("succeeded", "Hello world", "w2")


def test_renew_keeps_the_lease_alive(store: JobStore) -> None:
    job = _claim_one(store, "w1", SHORT_LEASE_S)

    for _ in range(3):
        time.sleep(SHORT_LEASE_S / 2)
        assert store.renew(job.id, "w1", SHORT_LEASE_S * 2)

    assert store.claim("w2", LONG_LEASE_S) is None
    renewed = store.get(job.id)
    assert renewed is not None and renewed.lease_expires_at is not None
    assert renewed.lease_expires_at > job.lease_expires_at  # type: ignore[operator]


def test_expired_job_with_a_cancel_request_ends_cancelled_instead_of_rerunning(store: JobStore) -> None:
    job = _claim_one(store, "w1", SHORT_LEASE_S)
    store.cancel(job.id)
    _expire()

    assert store.claim("w2", LONG_LEASE_S) is None

    final = store.get(job.id)
    assert final is not None and (final.status, final.attempts) == ("cancelled", 1)
    assert final.finished_at is not None and final.lease_expires_at is None


def test_max_attempts_fails_a_job_whose_workers_keep_dying(store: JobStore) -> None:
    job = _claim_one(store, "w1", SHORT_LEASE_S)
    _expire()
    again = store.claim("w2", SHORT_LEASE_S, max_attempts=2)
    assert again is not None and again.attempts == 2
    _expire()

    assert store.claim("w3", LONG_LEASE_S, max_attempts=2) is None

    final = store.get(job.id)
    assert final is not None and final.status == "failed" and final.attempts == 2
    assert final.error is not None and "2 times" in final.error


def test_lease_must_be_positive(store: JobStore) -> None:
    store.create("completion", {})
    with pytest.raises(ValueError, match="lease_s"):
        store.claim("w1", 0)
    assert store.counts()["queued"] == 1


def test_a_job_submitted_while_a_claim_begins_is_not_started_before_it_was_created(
        postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim's transaction opens, a job is submitted and committed, then the claim takes it: the claim's
    times are its statements' own, not its transaction's older start."""
    claimer, submitter = open_store(postgres_url), open_store(postgres_url)
    begin = claimer._db.transaction
    submitted: list[Job] = []

    @contextmanager
    def submitting_while_open(*, write: bool = True) -> Iterator[Tx]:
        with begin(write=write) as tx:
            time.sleep(0.05)
            submitted.append(submitter.create("chat", {"messages": []}))
            yield tx

    monkeypatch.setattr(claimer._db, "transaction", submitting_while_open)
    try:
        job = claimer.claim("w1", LONG_LEASE_S)
        assert job is not None and job.id == submitted[0].id
        assert job.started_at is not None and job.started_at >= job.created_at
    finally:
        claimer.close()
        submitter.close()
