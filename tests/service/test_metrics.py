"""The engine collector exports the host-RAM tier's counts (`--ssd-moe`) under their Prometheus names."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import EngineSnapshot
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
