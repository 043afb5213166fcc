"""Expert-cache counters: hits and misses by layer group and batch class, bytes moved, copies.

Torch-free and cheap per step; `CacheStats` is written by the engine thread and read by the metrics
exporter and the shutdown log through immutable snapshots.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BATCH_CLASSES = ("<=8", "9-32", ">32")
DECODE_MAX_TOKENS = 32  # larger steps are prefill: they stage experts and never use the decode window


def batch_class(num_tokens: int) -> str:
    if num_tokens < 1:
        raise ValueError(f"a step has at least one token, got {num_tokens}")
    if num_tokens <= 8:
        return BATCH_CLASSES[0]
    return BATCH_CLASSES[1] if num_tokens <= DECODE_MAX_TOKENS else BATCH_CLASSES[2]


def _ratio(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


@dataclass(frozen=True)
class GroupStats:
    group_id: int
    batch_class: str
    hits: int
    misses: int
    device: str = ""  # the device whose slots the group's are (`DeviceShare`)

    @property
    def hit_ratio(self) -> float:
        return _ratio(self.hits, self.misses)


@dataclass(frozen=True)
class DeviceShare:
    """One device's part of the expert cache: its groups, their bytes and slots (a split model has one a device)."""

    device: str
    group_ids: tuple[int, ...]
    cache_bytes: int
    num_slots: int


@dataclass(frozen=True)
class DeviceStats:
    """One device's part of the expert cache and what it did."""

    device: str
    cache_bytes: int
    num_slots: int
    hits: int
    misses: int
    recent_hit_ratio: float  # over the last decode steps
    promotions: int
    evictions: int
    uploaded_bytes: int

    @property
    def hit_ratio(self) -> float:
        return _ratio(self.hits, self.misses)


@dataclass(frozen=True)
class CacheStatsSnapshot:
    groups: tuple[GroupStats, ...]  # one per (group, batch class) seen, sorted
    uploaded_bytes: int
    streamed_bytes: int
    cpu_experts: int
    promotions: int
    evictions: int
    cache_bytes: int
    num_slots: int
    recent_hit_ratio: float  # over the last decode steps (see CacheStats.recent_steps)
    cpu_seconds: float = 0.0  # time the CPU spent computing misses (its tasks, cumulative)
    cpu_bytes: int = 0  # expert bytes the CPU read computing misses
    ram_hits: int = 0  # host-RAM tier (--ssd-moe): experts found in RAM
    ram_misses: int = 0  # experts read from the GGUF file into a RAM slot
    disk_reads: int = 0  # read calls (preadv) those took
    disk_read_bytes: int = 0
    ram_kept: int = 0  # experts the device cache evicted, copied back into the RAM tier
    devices: tuple[DeviceStats, ...] = ()  # each device's part (one for one device)

    def _select(self, batch: str | None) -> list[GroupStats]:
        if batch is not None and batch not in BATCH_CLASSES:
            raise ValueError(f"unknown batch class {batch!r}; one of {BATCH_CLASSES}")
        return [g for g in self.groups if batch is None or g.batch_class == batch]

    def hits(self, batch: str | None = None) -> int:
        """Hits of one batch class, or of all (None)."""
        return sum(g.hits for g in self._select(batch))

    def misses(self, batch: str | None = None) -> int:
        return sum(g.misses for g in self._select(batch))

    def hit_ratio(self, batch: str | None = None) -> float:
        return _ratio(self.hits(batch), self.misses(batch))


class CacheStats:
    """Thread-safe counters; `record_*` take one lock and a few additions."""

    def __init__(self, cache_bytes: int = 0, num_slots: int = 0, recent_steps: int = 64,
                 devices: Sequence[DeviceShare] = ()) -> None:
        self.cache_bytes = cache_bytes
        self.num_slots = num_slots
        self.recent_steps = recent_steps
        self.devices = tuple(devices)
        self._device_of = {g: d.device for d in self.devices for g in d.group_ids}
        self._lock = threading.Lock()
        self._hits: Counter[tuple[int, str]] = Counter()  # (group, batch class) -> picks
        self._misses: Counter[tuple[int, str]] = Counter()
        self._steps: Counter[str] = Counter()  # batch class -> steps
        self._totals: Counter[str] = Counter()  # bytes, experts and copies by name
        self._copies: Counter[tuple[int, str]] = Counter()  # (group, promotions | evictions | uploaded_bytes)
        # (hits, misses) by group, per decode step
        self._recent: deque[tuple[dict[int, int], dict[int, int]]] = deque(maxlen=recent_steps)

    def record_step(
        self,
        num_tokens: int,
        hits: Mapping[int, int],
        misses: Mapping[int, int],
        streamed_bytes: int = 0,
        cpu_experts: int = 0,
    ) -> None:
        """One step: hits and misses per group (picks of routed experts in host RAM)."""
        batch = batch_class(num_tokens)
        with self._lock:
            self._steps[batch] += 1
            self._hits.update({(g, batch): n for g, n in hits.items()})
            self._misses.update({(g, batch): n for g, n in misses.items()})
            self._totals.update(streamed_bytes=streamed_bytes, cpu_experts=cpu_experts)
            if num_tokens <= DECODE_MAX_TOKENS:
                self._recent.append((dict(hits), dict(misses)))

    def record_copies(self, promotions: int, evictions: int, uploaded_bytes: int, group: int = -1) -> None:
        """Copies of one group's slots (-1: of none in particular)."""
        with self._lock:
            self._totals.update(promotions=promotions, evictions=evictions, uploaded_bytes=uploaded_bytes)
            self._copies.update({(group, "promotions"): promotions, (group, "evictions"): evictions,
                                 (group, "uploaded_bytes"): uploaded_bytes})

    def record_ram_tier(self, hits: int, misses: int, reads: int, read_bytes: int) -> None:
        """One load of the host-RAM tier: experts found in RAM, and those read from disk."""
        with self._lock:
            self._totals.update(ram_hits=hits, ram_misses=misses, disk_reads=reads, disk_read_bytes=read_bytes)

    def record_ram_tier_kept(self, experts: int) -> None:
        """Experts the device cache evicted and the host-RAM tier took back (copied from their slots)."""
        with self._lock:
            self._totals.update(ram_kept=experts)

    def snapshot(self) -> CacheStatsSnapshot:
        with self._lock:
            keys = sorted(
                set(self._hits) | set(self._misses), key=lambda k: (k[0], BATCH_CLASSES.index(k[1]))
            )
            groups = tuple(GroupStats(g, b, self._hits[(g, b)], self._misses[(g, b)], self._device_of.get(g, ""))
                           for g, b in keys)
            recent_hits = sum(sum(h.values()) for h, _ in self._recent)
            recent_misses = sum(sum(m.values()) for _, m in self._recent)
            totals = dict(self._totals)
            devices = tuple(self._device_stats(d, groups) for d in self.devices)
        return CacheStatsSnapshot(
            groups=groups,
            uploaded_bytes=totals.get("uploaded_bytes", 0),
            streamed_bytes=totals.get("streamed_bytes", 0),
            cpu_experts=totals.get("cpu_experts", 0),
            promotions=totals.get("promotions", 0),
            evictions=totals.get("evictions", 0),
            cache_bytes=self.cache_bytes,
            num_slots=self.num_slots,
            recent_hit_ratio=_ratio(recent_hits, recent_misses),
            ram_hits=totals.get("ram_hits", 0),
            ram_misses=totals.get("ram_misses", 0),
            disk_reads=totals.get("disk_reads", 0),
            disk_read_bytes=totals.get("disk_read_bytes", 0),
            ram_kept=totals.get("ram_kept", 0),
            devices=devices,
        )

    def _device_stats(self, share: DeviceShare, groups: tuple[GroupStats, ...]) -> DeviceStats:
        """One device's counts (its groups'), under the lock."""
        mine = set(share.group_ids)
        recent = [(sum(n for g, n in h.items() if g in mine), sum(n for g, n in m.items() if g in mine))
                  for h, m in self._recent]
        copies = {name: sum(self._copies[(g, name)] for g in mine)
                  for name in ("promotions", "evictions", "uploaded_bytes")}
        return DeviceStats(share.device, share.cache_bytes, share.num_slots,
                           sum(g.hits for g in groups if g.group_id in mine),
                           sum(g.misses for g in groups if g.group_id in mine),
                           _ratio(sum(h for h, _ in recent), sum(m for _, m in recent)), **copies)

    def summary_lines(self) -> list[str]:
        """One line per batch class (and per device where there are several), for the shutdown log."""
        snap = self.snapshot()
        with self._lock:
            steps = dict(self._steps)
        return [
            f"expert cache, batches {b} tokens: {steps.get(b, 0)} steps, {snap.hits(b)} hits, "
            f"{snap.misses(b)} misses, hit ratio {snap.hit_ratio(b):.1%}"
            for b in BATCH_CLASSES
        ] + [f"expert cache on {d.device}: {d.num_slots} slots, {d.hits} hits, {d.misses} misses, hit ratio "
             f"{d.hit_ratio:.1%}" for d in snap.devices if len(snap.devices) > 1] \
            + ([f"host-RAM tier: {snap.ram_hits} hits, {snap.ram_misses} misses, {snap.disk_reads} disk reads, "
              f"{snap.disk_read_bytes / 2**20:.1f} MiB read, {snap.ram_kept} taken back from the device cache"]
             if snap.ram_hits + snap.ram_misses else [])
