"""Expert-cache counters: batch classes, snapshots, the recent window and thread safety."""

from __future__ import annotations

import threading

import pytest

from engine.expert_cache.stats import BATCH_CLASSES, CacheStats, GroupStats, batch_class


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(1, "<=8"), (8, "<=8"), (9, "9-32"), (32, "9-32"), (33, ">32")]
)
def test_batch_class_boundaries(num_tokens: int, expected: str) -> None:
    assert batch_class(num_tokens) == expected


def test_batch_class_rejects_empty_steps() -> None:
    with pytest.raises(ValueError):
        batch_class(0)


def test_snapshot_aggregates_by_group_and_batch_class() -> None:
    stats = CacheStats(cache_bytes=1000, num_slots=10)
    stats.record_step(1, {0: 6, 1: 2}, {0: 2, 1: 6}, streamed_bytes=100, cpu_experts=3)
    stats.record_step(4, {0: 8}, {0: 0})
    stats.record_step(64, {0: 10}, {0: 90})
    stats.record_copies(promotions=5, evictions=2, uploaded_bytes=500)
    snap = stats.snapshot()
    assert snap.groups == (
        GroupStats(0, "<=8", 14, 2),
        GroupStats(0, ">32", 10, 90),
        GroupStats(1, "<=8", 2, 6),
    )
    assert (snap.hits("<=8"), snap.misses("<=8")) == (16, 8)
    assert snap.hit_ratio("9-32") == 0.0 and snap.hit_ratio() == pytest.approx(26 / 124)
    assert (snap.streamed_bytes, snap.cpu_experts) == (100, 3)
    assert (snap.promotions, snap.evictions, snap.uploaded_bytes) == (5, 2, 500)
    assert (snap.cache_bytes, snap.num_slots) == (1000, 10)
    assert snap.groups[0].hit_ratio == pytest.approx(14 / 16)


def test_unknown_batch_class_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown batch class"):
        CacheStats().snapshot().hits("<=4")


def test_recent_hit_ratio_covers_the_last_decode_steps_only() -> None:
    stats = CacheStats(recent_steps=2)
    stats.record_step(1, {0: 0}, {0: 8})
    stats.record_step(1, {0: 4}, {0: 4})
    stats.record_step(1, {0: 8}, {0: 0})
    stats.record_step(100, {0: 0}, {0: 800})  # prefill: not a decode step
    assert stats.snapshot().recent_hit_ratio == pytest.approx(12 / 16)


def test_summary_has_one_line_per_batch_class() -> None:
    stats = CacheStats()
    stats.record_step(2, {0: 3}, {0: 1})
    lines = stats.summary_lines()
    assert len(lines) == len(BATCH_CLASSES)
    assert "<=8" in lines[0] and "1 steps" in lines[0] and "hit ratio 75.0%" in lines[0]
    assert "0 steps" in lines[2]


def test_snapshots_while_recording_are_consistent() -> None:
    stats = CacheStats()
    errors: list[BaseException] = []
    done = threading.Event()

    def write() -> None:
        for group_id in range(5000):  # new keys keep growing the tables a snapshot walks
            stats.record_step(1, {group_id: 1}, {group_id: 1})
            stats.record_copies(1, 1, 10)
        done.set()

    def read() -> None:
        try:
            while not done.is_set():
                snap = stats.snapshot()
                assert snap.hits() == snap.misses() == len(snap.groups)
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    snap = stats.snapshot()
    assert (snap.hits(), snap.misses(), snap.promotions, snap.uploaded_bytes) == (5000, 5000, 5000, 50000)
