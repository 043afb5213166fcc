"""The engine collector exports the host-RAM tier's counts (`--ssd-moe`) under their Prometheus names, and the expert
cache's series by device."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import EngineSnapshot
from engine.expert_cache.stats import CacheStatsSnapshot, DeviceStats, GroupStats
from service.metrics import EMPTY_CACHE, EngineCollector


def test_disk_reads_and_ram_tier_hits_are_counters() -> None:
    cache = replace(EMPTY_CACHE, ram_hits=7, ram_misses=3, disk_reads=9, disk_read_bytes=3 << 20)
    registry = CollectorRegistry()
    registry.register(EngineCollector("m", lambda: EngineSnapshot(cache=cache), lambda: 0))
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    assert samples["moecache_expert_disk_read_bytes_total"] == 3 << 20
    assert samples["moecache_expert_disk_reads_total"] == 9
    assert samples["moecache_expert_ram_tier_hits_total"] == 7
    assert samples["moecache_expert_ram_tier_misses_total"] == 3


def samples_of(cache: CacheStatsSnapshot) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(EngineCollector("m", lambda: EngineSnapshot(cache=cache), lambda: 0))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_expert_cache_series_carry_each_device() -> None:
    devices = (DeviceStats("cuda:0", 300, 3, 9, 3, 0.75, 4, 1, 120), DeviceStats("cuda:1", 100, 1, 2, 2, 0.5, 1, 0, 40))
    groups = (GroupStats(0, "<=8", 9, 3, "cuda:0"), GroupStats(1, "<=8", 2, 2, "cuda:1"))
    samples = samples_of(replace(EMPTY_CACHE, groups=groups, devices=devices))
    by_device = {name: {s.labels["device"]: s.value for s in samples[name]} for name in (
        "moecache_expert_cache_bytes", "moecache_expert_cache_slots", "moecache_expert_cache_hit_ratio",
        "moecache_expert_cache_promotions", "moecache_expert_cache_evictions", "moecache_expert_upload_bytes")}
    assert by_device == {
        "moecache_expert_cache_bytes": {"cuda:0": 300, "cuda:1": 100},
        "moecache_expert_cache_slots": {"cuda:0": 3, "cuda:1": 1},
        "moecache_expert_cache_hit_ratio": {"cuda:0": 0.75, "cuda:1": 0.5},
        "moecache_expert_cache_promotions": {"cuda:0": 4, "cuda:1": 1},
        "moecache_expert_cache_evictions": {"cuda:0": 1, "cuda:1": 0},
        "moecache_expert_upload_bytes": {"cuda:0": 120, "cuda:1": 40}}
    hits = {(s.labels["device"], s.labels["group"]): s.value for s in samples["moecache_expert_cache_hits"]
            if s.name.endswith("_total")}
    assert hits == {("cuda:0", "0"): 9, ("cuda:1", "1"): 2}


def test_before_the_first_snapshot_the_cache_series_are_there_with_no_device() -> None:
    samples = samples_of(EMPTY_CACHE)
    assert [(s.labels["device"], s.value) for s in samples["moecache_expert_cache_slots"]] == [("", 0)]
