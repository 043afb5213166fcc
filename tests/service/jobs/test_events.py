"""Streamed output: append persists event and text together; events are gap-free and resumable."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.jobs import JobEvent, JobStore

LEASE_S = 30.0

chunk_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
chunks = st.lists(st.tuples(chunk_text, st.lists(st.integers(0, 2**31 - 1), max_size=4)), min_size=1, max_size=12)


def _running_job(store: JobStore, worker_id: str = "w1") -> str:
    store.create("completion", {"prompt": "once upon"})
    job = store.claim(worker_id, LEASE_S)
    assert job is not None
    return job.id


def test_append_returns_consecutive_seqs_and_grows_the_job(store: JobStore) -> None:
    job_id = _running_job(store)

    seqs = [store.append(job_id, "w1", text, ids) for text, ids in [(" a", [5]), (" time", [6, 7]), ("", [])]]

    assert seqs == [1, 2, 3]
    job = store.get(job_id)
    assert job is not None and (job.text, job.progress_tokens) == (" a time", 3)
    assert store.events(job_id) == [
        JobEvent(seq=1, text=" a", token_ids=(5,)),
        JobEvent(seq=2, text=" time", token_ids=(6, 7)),
        JobEvent(seq=3, text="", token_ids=()),
    ]


def test_events_resume_after_any_seq_and_page_with_limit(store: JobStore) -> None:
    job_id = _running_job(store)
    for i in range(6):
        store.append(job_id, "w1", f"t{i}", [i])

    assert [e.seq for e in store.events(job_id, after_seq=4)] == [5, 6]
    assert [e.seq for e in store.events(job_id, after_seq=1, limit=2)] == [2, 3]
    assert store.events(job_id, after_seq=6) == []


def test_events_of_separate_jobs_are_numbered_separately(store: JobStore) -> None:
    first, second = _running_job(store, "w1"), _running_job(store, "w2")

    assert store.append(first, "w1", "a", [1]) == 1
    assert store.append(second, "w2", "b", [2]) == 1
    assert store.append(first, "w1", "c", [3]) == 2
    assert [e.text for e in store.events(second)] == ["b"]


def test_nul_characters_are_stored_as_replacement_characters(store: JobStore) -> None:
    job_id = _running_job(store)

    store.append(job_id, "w1", "a\x00b", [0])
    assert store.finish(job_id, "w1", "failed", error="bad\x00byte")

    assert store.events(job_id)[0].text == "a\ufffdb"
    job = store.get(job_id)
    assert job is not None and (job.text, job.error) == ("a\ufffdb", "bad\ufffdbyte")


def test_events_of_an_unknown_job_are_empty(store: JobStore) -> None:
    assert store.events("job_missing") == []


def test_events_limit_must_be_positive(store: JobStore) -> None:
    with pytest.raises(ValueError, match="limit"):
        store.events(_running_job(store), limit=0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=chunks, data=st.data())
def test_any_resume_point_replays_exactly_the_rest(
    store: JobStore, chunks: list[tuple[str, list[int]]], data: st.DataObject
) -> None:
    # each example gets its own job, so examples sharing the store do not interfere
    job_id = _running_job(store)
    for text, ids in chunks:
        store.append(job_id, "w1", text, ids)
    after = data.draw(st.integers(0, len(chunks)), label="after_seq")

    replay = store.events(job_id, after_seq=after)

    assert [(e.text, list(e.token_ids)) for e in replay] == chunks[after:]
    assert [e.seq for e in replay] == list(range(after + 1, len(chunks) + 1))
    job = store.get(job_id)
    assert job is not None and job.text == "".join(text for text, _ in chunks)
    assert job.progress_tokens == sum(len(ids) for _, ids in chunks)
