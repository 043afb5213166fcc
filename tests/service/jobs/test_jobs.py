"""The job queue contract, run against SQLite and PostgreSQL: create, get, list, cancel, claim, counts."""

from __future__ import annotations

import pytest

from service.jobs import Job, JobStore, NewJob, QueueFull

LEASE_S = 30.0


def _create(store: JobStore, n: int) -> list[Job]:
    return [store.create("completion", {"prompt": f"p{i}", "max_tokens": i}) for i in range(n)]


def test_create_then_get_returns_the_queued_job(store: JobStore) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    job = store.create("chat", request, batch_id="batch_1", custom_id="req-7")

    assert job.id.startswith("job_")
    assert (job.kind, job.status, job.request) == ("chat", "queued", request)
    assert (job.batch_id, job.custom_id) == ("batch_1", "req-7")
    assert (job.attempts, job.progress_tokens, job.text, job.worker_id) == (0, 0, "", None)
    assert job.started_at is None and job.finished_at is None and not job.cancel_requested
    assert store.get(job.id) == job


def test_request_body_keeps_its_key_order(store: JobStore) -> None:
    job = store.create("completion", {"z": 1, "a": 2, "m": {"y": 1, "b": 2}})

    stored = store.get(job.id)
    assert stored is not None
    assert list(stored.request) == ["z", "a", "m"] and list(stored.request["m"]) == ["y", "b"]


def test_get_unknown_job_is_none(store: JobStore) -> None:
    assert store.get("job_missing") is None


def test_create_rejects_unknown_kind(store: JobStore) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.create("embedding", {})  # type: ignore[arg-type]


def test_list_pages_newest_first(store: JobStore) -> None:
    ids = [job.id for job in _create(store, 5)]

    first = store.list(limit=2)
    second = store.list(limit=2, after=first[-1].id)
    last = store.list(limit=2, after=second[-1].id)

    assert [j.id for j in first + second + last] == ids[::-1]
    assert store.list(limit=2, after=last[-1].id) == []


def test_list_filters_by_status(store: JobStore) -> None:
    jobs = _create(store, 3)
    store.cancel(jobs[1].id)

    assert [j.id for j in store.list(status="cancelled")] == [jobs[1].id]
    assert [j.id for j in store.list(status="queued")] == [jobs[2].id, jobs[0].id]
    with pytest.raises(ValueError, match="status"):
        store.list(status="done")


def test_create_many_is_all_or_nothing_under_the_queue_limit(store: JobStore) -> None:
    _create(store, 2)
    new_jobs = [NewJob("chat", {"i": i}, batch_id="b", custom_id=str(i)) for i in range(3)]

    with pytest.raises(QueueFull):
        store.create_many(new_jobs, max_queued=4)
    assert store.counts()["queued"] == 2

    created = store.create_many(new_jobs, max_queued=5)
    assert [j.custom_id for j in created] == ["0", "1", "2"]
    assert [j.id for j in store.list_batch_jobs("b")] == [j.id for j in created]


def test_queue_full_counts_only_queued_jobs(store: JobStore) -> None:
    _create(store, 2)
    with pytest.raises(QueueFull):
        store.create("completion", {}, max_queued=2)

    claimed = store.claim("w1", LEASE_S)
    assert claimed is not None
    assert store.create("completion", {}, max_queued=2).status == "queued"


def test_claim_takes_the_oldest_queued_job(store: JobStore) -> None:
    jobs = _create(store, 3)

    claimed = [store.claim("w1", LEASE_S) for _ in range(3)]

    assert [j.id for j in claimed if j] == [j.id for j in jobs]
    assert store.claim("w1", LEASE_S) is None


def test_claim_makes_the_job_running_and_owned(store: JobStore) -> None:
    job = _create(store, 1)[0]

    claimed = store.claim("w1", LEASE_S)

    assert claimed is not None and claimed.id == job.id
    assert (claimed.status, claimed.worker_id, claimed.attempts) == ("running", "w1", 1)
    assert claimed.started_at is not None and claimed.started_at >= job.created_at
    assert claimed.lease_expires_at == pytest.approx(claimed.started_at + LEASE_S, abs=1.0)


def test_cancel_queued_job_ends_it_at_once(store: JobStore) -> None:
    job = _create(store, 1)[0]

    cancelled = store.cancel(job.id)

    assert cancelled is not None
    assert (cancelled.status, cancelled.cancel_requested) == ("cancelled", True)
    assert cancelled.finished_at is not None
    assert store.claim("w1", LEASE_S) is None


def test_cancel_running_job_asks_its_owner_to_stop(store: JobStore) -> None:
    _create(store, 1)
    claimed = store.claim("w1", LEASE_S)
    assert claimed is not None

    requested = store.cancel(claimed.id)

    assert requested is not None
    assert (requested.status, requested.cancel_requested) == ("running", True)
    assert store.append(claimed.id, "w1", "partial", [1]) == 1
    assert store.finish(claimed.id, "w1", "cancelled")
    final = store.get(claimed.id)
    assert final is not None and (final.status, final.text) == ("cancelled", "partial")


def test_cancel_finished_job_changes_nothing(store: JobStore) -> None:
    _create(store, 1)
    claimed = store.claim("w1", LEASE_S)
    assert claimed is not None
    assert store.finish(claimed.id, "w1", "succeeded", result={"ok": True})
    finished = store.get(claimed.id)

    assert store.cancel(claimed.id) == finished


def test_cancel_unknown_job_is_none(store: JobStore) -> None:
    assert store.cancel("job_missing") is None


def test_counts_every_status(store: JobStore) -> None:
    jobs = _create(store, 5)
    store.cancel(jobs[4].id)
    first, second, _ = (store.claim("w1", LEASE_S) for _ in range(3))
    assert first is not None and second is not None
    store.finish(first.id, "w1", "succeeded")
    store.finish(second.id, "w1", "failed", error="boom")

    assert store.counts() == {"queued": 1, "running": 1, "succeeded": 1, "failed": 1, "cancelled": 1}


def test_counts_of_an_empty_store_are_zero(store: JobStore) -> None:
    assert set(store.counts().values()) == {0} and len(store.counts()) == 5
