"""Prometheus metrics; the only module that imports prometheus_client.

Counters and gauges that mirror the engine's own totals are read from its latest snapshot at scrape
time by a custom collector, so they can neither double count nor drift. Request latencies are
histograms observed as each request finishes. Jobs by state are counted in the job store at scrape
time too. Every server has its own registry (tests run several servers in one process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import EngineSnapshot, RequestMetrics
from engine.expert_cache.stats import CacheStatsSnapshot, DeviceStats

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
EMPTY_CACHE = CacheStatsSnapshot((), 0, 0, 0, 0, 0, 0, 0, 0.0)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)


class EngineCollector(Collector):
    """The engine's counters and gauges, read from its latest published snapshot at scrape time."""

    def __init__(self, model: str, snapshot: Callable[[], EngineSnapshot], num_queued: Callable[[], int]) -> None:
        self.model = model
        self.snapshot = snapshot
        self.num_queued = num_queued  # requests waiting to be handed to the engine (admission queue)

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        yield from self._engine(snap)
        yield from self._cache_picks(snap.cache or EMPTY_CACHE)
        yield from self._cache_devices(snap.cache or EMPTY_CACHE)
        yield from self._cache_totals(snap.cache or EMPTY_CACHE)

    def _engine(self, snap: EngineSnapshot) -> Iterator[Metric]:
        s = self.model
        stats = snap.stats
        yield _counter("moecache_prompt_tokens", "Prompt tokens prefilled.", s, stats.prompt_tokens)
        yield _counter("moecache_generation_tokens", "Tokens generated.", s, stats.generation_tokens)
        yield _gauge("moecache_decode_tokens_per_second", "Decode speed of the last decode step.", s,
                     stats.decode_tokens_per_second)
        yield _gauge("moecache_requests_running", "Requests holding a KV-cache slot.", s, stats.num_running)
        yield _gauge("moecache_requests_waiting", "Requests waiting for a KV-cache slot or for admission.", s,
                     stats.num_waiting + self.num_queued())
        yield _gauge("moecache_kv_cache_usage_ratio", "Share of KV-cache positions in use.", s, stats.kv_usage)

    def _cache_picks(self, cache: CacheStatsSnapshot) -> Iterator[Metric]:
        labels = ["model", "device", "group", "batch_class"]
        hits = CounterMetricFamily("moecache_expert_cache_hits", "Routed-expert picks served from the "
                                   "expert cache.", labels=labels)
        misses = CounterMetricFamily("moecache_expert_cache_misses", "Routed-expert picks not in the expert "
                                     "cache (computed from host RAM).", labels=labels)
        for g in cache.groups:
            hits.add_metric([self.model, g.device, str(g.group_id), g.batch_class], g.hits)
            misses.add_metric([self.model, g.device, str(g.group_id), g.batch_class], g.misses)
        yield hits
        yield misses

    def _cache_devices(self, cache: CacheStatsSnapshot) -> Iterator[Metric]:
        """The expert cache's series by device (one device: one series each; before the engine's first snapshot,
        the totals with no device)."""
        devices = cache.devices or (DeviceStats("", cache.cache_bytes, cache.num_slots, cache.hits(), cache.misses(),
                                                cache.recent_hit_ratio, cache.promotions, cache.evictions,
                                                cache.uploaded_bytes),)
        for kind, name, doc, value in (
                (GaugeMetricFamily, "moecache_expert_cache_hit_ratio", "Expert-cache hit ratio over the recent decode "
                 "steps.", lambda d: d.recent_hit_ratio),
                (CounterMetricFamily, "moecache_expert_upload_bytes", "Bytes copied into expert-cache slots.",
                 lambda d: d.uploaded_bytes),
                (GaugeMetricFamily, "moecache_expert_cache_bytes", "Device memory of the expert cache.",
                 lambda d: d.cache_bytes),
                (GaugeMetricFamily, "moecache_expert_cache_slots", "Expert slots in the expert cache.",
                 lambda d: d.num_slots),
                (CounterMetricFamily, "moecache_expert_cache_promotions", "Experts copied into the cache.",
                 lambda d: d.promotions),
                (CounterMetricFamily, "moecache_expert_cache_evictions", "Experts evicted from the cache.",
                 lambda d: d.evictions)):
            family = kind(name, doc, labels=["model", "device"])
            for d in devices:
                family.add_metric([self.model, d.device], value(d))
            yield family

    def _cache_totals(self, cache: CacheStatsSnapshot) -> Iterator[Metric]:
        s = self.model
        yield _counter("moecache_expert_stream_bytes", "Expert bytes the device read from host memory.", s,
                       cache.streamed_bytes)
        yield _counter("moecache_expert_cpu_computed", "Routed-expert picks computed on the CPU.", s,
                       cache.cpu_experts)
        yield _counter("moecache_expert_cpu_seconds", "Seconds the CPU spent computing missed experts.", s,
                       cache.cpu_seconds)
        yield _counter("moecache_expert_cpu_bytes", "Expert bytes the CPU read computing missed experts.", s,
                       cache.cpu_bytes)
        yield _counter("moecache_expert_ram_tier_hits", "Experts of layers on disk (--ssd-moe) found in the host-RAM "
                       "tier.", s, cache.ram_hits)
        yield _counter("moecache_expert_ram_tier_misses", "Experts of layers on disk read from the GGUF file into the "
                       "host-RAM tier.", s, cache.ram_misses)
        yield _counter("moecache_expert_disk_reads", "Read calls of experts from the GGUF file.", s, cache.disk_reads)
        yield _counter("moecache_expert_ram_tier_kept", "Experts the device cache evicted, copied back into the "
                       "host-RAM tier.", s, cache.ram_kept)
        yield _counter("moecache_expert_disk_read_bytes", "Expert bytes read from the GGUF file.", s,
                       cache.disk_read_bytes)


class JobsCollector(Collector):
    """Jobs by state, counted in the (possibly shared) job store at scrape time."""

    def __init__(self, model: str, counts: Callable[[], dict[str, int]]) -> None:
        self.model = model
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        try:
            counts = self.counts()
        except Exception:  # an unreachable store must not fail the whole scrape
            log.exception("counting jobs for /metrics failed")
            return
        family = GaugeMetricFamily("moecache_jobs", "Jobs in the job store by state.", labels=["model", "state"])
        for state, count in counts.items():
            family.add_metric([self.model, state], count)
        yield family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model"])
    family.add_metric([model], value)
    return family


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model"])
    family.add_metric([model], value)
    return family


class Metrics:
    """One server's registry: the engine collector plus the request histograms and counters."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.ttft = self._histogram("moecache_time_to_first_token_seconds", "Arrival to the first token.",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("moecache_inter_token_latency_seconds", "Time between two tokens of a "
                                   "request.", ITL_BUCKETS)
        self.e2e = self._histogram("moecache_e2e_request_latency_seconds", "Arrival to the last output.",
                                   E2E_BUCKETS)
        self.queue = self._histogram("moecache_request_queue_time_seconds", "Arrival to the first step that "
                                     "computes the request.", QUEUE_BUCKETS)
        self.job_latency = self._histogram("moecache_job_latency_seconds", "Job submit to finish, for the jobs "
                                           "this server finished.", JOB_BUCKETS)
        self.success = Counter("moecache_request_success", "Finished requests by finish reason.",
                               ["model", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.success.labels(model, reason)
        self.job_latency.labels(model)  # exported (empty) before the first job finishes

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry)

    def watch(self, snapshot: Callable[[], EngineSnapshot], num_queued: Callable[[], int]) -> None:
        """Export the engine's counters and gauges from `snapshot()` at every scrape."""
        self.registry.register(EngineCollector(self.model, snapshot, num_queued))

    def watch_jobs(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export `counts()` (jobs by state) at every scrape."""
        self.registry.register(JobsCollector(self.model, counts))

    def observe_job(self, seconds: float) -> None:
        self.job_latency.labels(self.model).observe(max(0.0, seconds))

    def observe(self, m: RequestMetrics) -> None:
        """Record one finished request."""
        model = self.model
        self.success.labels(model, m.finish_reason).inc()
        self.queue.labels(model).observe(m.queue_time)
        self.e2e.labels(model).observe(m.e2e_latency)
        if m.time_to_first_token is not None:
            self.ttft.labels(model).observe(m.time_to_first_token)
        itl = self.itl.labels(model)
        for gap in m.inter_token_latencies:
            itl.observe(gap)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
