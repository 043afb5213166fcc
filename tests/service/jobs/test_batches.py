"""Storage for the OpenAI Batch API: files and batches, and a batch's jobs."""

from __future__ import annotations

import dataclasses

import pytest

from service.jobs import BatchRequestCounts, JobStore, NewJob

INPUT = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def _batch_id(store: JobStore) -> str:
    file = store.create_file("batch", "input.jsonl", INPUT)
    return store.create_batch(file.id, "/v1/chat/completions").id


def test_file_round_trip(store: JobStore) -> None:
    data = bytes(range(256)) * 3

    file = store.create_file("batch", "in.jsonl", data)

    assert file.id.startswith("file-") and file.object == "file"
    assert (file.bytes, file.filename, file.purpose) == (len(data), "in.jsonl", "batch")
    assert isinstance(file.created_at, int)
    assert store.get_file(file.id) == file
    assert store.file_content(file.id) == data


def test_unknown_file_is_none(store: JobStore) -> None:
    assert store.get_file("file-missing") is None
    assert store.file_content("file-missing") is None
    assert not store.delete_file("file-missing")


def test_list_files_pages_newest_first_and_filters_by_purpose(store: JobStore) -> None:
    files = [store.create_file("batch" if i % 2 else "batch_output", f"f{i}", b"x") for i in range(5)]

    first = store.list_files(limit=3)
    rest = store.list_files(limit=3, after=first[-1].id)

    assert [f.id for f in first + rest] == [f.id for f in reversed(files)]
    assert [f.id for f in store.list_files(purpose="batch")] == [files[3].id, files[1].id]


def test_delete_file_removes_it(store: JobStore) -> None:
    file = store.create_file("batch", "gone.jsonl", b"x")

    assert store.delete_file(file.id)

    assert store.get_file(file.id) is None and store.file_content(file.id) is None
    assert store.list_files() == []


def test_create_batch_has_openai_fields(store: JobStore) -> None:
    file = store.create_file("batch", "input.jsonl", INPUT)

    batch = store.create_batch(file.id, "/v1/chat/completions", "24h", {"team": "search"})

    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert (batch.status, batch.input_file_id, batch.endpoint) == ("validating", file.id, "/v1/chat/completions")
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert batch.request_counts == BatchRequestCounts(0, 0, 0) and batch.metadata == {"team": "search"}
    assert store.get_batch(batch.id) == batch
    assert set(dataclasses.asdict(batch)["request_counts"]) == {"total", "completed", "failed"}


def test_completion_window_must_be_hours(store: JobStore) -> None:
    with pytest.raises(ValueError, match="completion_window"):
        store.create_batch("file-x", "/v1/completions", "1d")


def test_update_batch_moves_through_its_statuses_and_stamps_them(store: JobStore) -> None:
    batch_id = _batch_id(store)

    running = store.update_batch(batch_id, status="in_progress", request_counts=BatchRequestCounts(total=2))
    counted = store.update_batch(batch_id, request_counts=BatchRequestCounts(2, 1, 1))
    done = store.update_batch(batch_id, status="completed", output_file_id="file-out", error_file_id="file-err")

    assert running is not None and running.in_progress_at is not None and running.completed_at is None
    assert counted is not None and counted.request_counts == BatchRequestCounts(2, 1, 1)
    assert counted.in_progress_at == running.in_progress_at
    assert done is not None and done.status == "completed" and done.completed_at is not None
    assert (done.output_file_id, done.error_file_id) == ("file-out", "file-err")


def test_a_finished_batch_never_changes(store: JobStore) -> None:
    batch_id = _batch_id(store)
    failed = store.update_batch(batch_id, status="failed", errors={"data": [{"code": "invalid_json"}]})

    assert failed is not None and failed.errors == {"data": [{"code": "invalid_json"}]}
    assert store.update_batch(batch_id, status="in_progress") == failed
    assert store.cancel_batch(batch_id) == failed


def test_update_batch_rejects_unknown_status(store: JobStore) -> None:
    with pytest.raises(ValueError, match="batch status"):
        store.update_batch(_batch_id(store), status="paused")  # type: ignore[arg-type]


def test_unknown_batch_is_none(store: JobStore) -> None:
    assert store.get_batch("batch_missing") is None
    assert store.update_batch("batch_missing", status="completed") is None
    assert store.cancel_batch("batch_missing") is None


def test_cancel_batch_cancels_its_jobs(store: JobStore) -> None:
    batch_id = _batch_id(store)
    store.update_batch(batch_id, status="in_progress")
    jobs = store.create_many([NewJob("chat", {"i": i}, batch_id=batch_id, custom_id=f"c{i}") for i in range(3)])
    other = store.create("chat", {})
    running = store.claim("w1", 30.0)
    assert running is not None and running.id == jobs[0].id

    cancelling = store.cancel_batch(batch_id)

    assert cancelling is not None and cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    statuses = [(j.custom_id, j.status, j.cancel_requested) for j in store.list_batch_jobs(batch_id)]
    assert statuses == [("c0", "running", True), ("c1", "cancelled", True), ("c2", "cancelled", True)]
    assert store.get(other.id) == other
    assert store.finish(running.id, "w1", "cancelled")
    cancelled = store.update_batch(batch_id, status="cancelled")
    assert cancelled is not None and cancelled.status == "cancelled" and cancelled.cancelled_at is not None


def test_list_batches_pages_newest_first(store: JobStore) -> None:
    ids = [_batch_id(store) for _ in range(3)]

    first = store.list_batches(limit=2)
    rest = store.list_batches(limit=2, after=first[-1].id)

    assert [b.id for b in first + rest] == ids[::-1]
