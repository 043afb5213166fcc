"""What the engine learns from each step's record, off the critical path: hits and misses by group and
batch class, bytes streamed and experts computed by the CPU (stats), the recent use of every expert
(the web page's heatmap) and a profile of expert use (`--cache-profile-out`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from engine.expert_cache.plan import CachePlan
from engine.expert_cache.profile import Profile
from engine.expert_cache.record import HIT, LANDED, ON_CPU, STAGED, StepRecord
from engine.expert_cache.stats import CacheStats

USAGE_DECAY = 0.95  # per step: the usage heatmap shows roughly the last 20 steps


class CacheObservers:
    def __init__(self, stats: CacheStats, plan: CachePlan, moe_layers: list[int], host_layers: list[int],
                 expert_bytes: Mapping[int, int], num_layers: int, num_experts: int, profile: bool = False) -> None:
        self.stats, self.moe_layers = stats, moe_layers
        row = {layer: i for i, layer in enumerate(moe_layers)}
        self.host_rows = np.array([row[layer] for layer in host_layers], dtype=np.int64)
        self.group_rows = {g.group_id: np.array([row[x] for x in g.layers]) for g in plan.groups}
        self.row_bytes = np.array([expert_bytes.get(layer, 0) for layer in moe_layers], dtype=np.int64)
        self.usage = np.zeros((num_layers, num_experts), dtype=np.float32)  # recent picks, decayed per step
        self.profile = Profile() if profile else None

    def observe(self, record: StepRecord) -> None:
        self._count_usage(record)
        if self.profile is not None:
            for row, layer in enumerate(self.moe_layers):
                ids = record.ids[row]
                self.profile.add(layer, ids[ids >= 0].tolist())
        if len(self.host_rows):
            self._count_cache(record)

    def _count_usage(self, record: StepRecord) -> None:
        self.usage *= USAGE_DECAY
        valid = record.ids >= 0
        layers = np.broadcast_to(np.array(self.moe_layers)[:, None], record.ids.shape)[valid]
        cells = np.bincount(layers * self.usage.shape[1] + record.ids[valid], minlength=self.usage.size)
        self.usage += cells.reshape(self.usage.shape).astype(np.float32)

    def _count_cache(self, record: StepRecord) -> None:
        hits, misses = {}, {}
        for gid, rows in self.group_rows.items():
            outcome = record.outcome[rows]
            hits[gid] = int((outcome == HIT).sum())
            misses[gid] = int(((outcome == STAGED) | (outcome == LANDED) | (outcome == ON_CPU)).sum())
        streamed = self._unique_bytes(record, (STAGED, LANDED))
        on_cpu = self._unique_count(record, (ON_CPU,))
        self.stats.record_step(record.num_tokens, hits, misses, streamed, on_cpu)

    def _unique_mask(self, record: StepRecord, outcomes: tuple[int, ...]) -> np.ndarray:
        """`[moe_layers, experts]` bool: the experts of each layer with a pair of these outcomes."""
        rows = self.host_rows
        mask = np.isin(record.outcome[rows], outcomes)
        seen = np.zeros((len(self.moe_layers), self.usage.shape[1]), dtype=bool)
        r = np.broadcast_to(rows[:, None], mask.shape)[mask]
        seen[r, record.ids[rows][mask]] = True
        return seen

    def _unique_bytes(self, record: StepRecord, outcomes: tuple[int, ...]) -> int:
        return int((self._unique_mask(record, outcomes).sum(axis=1) * self.row_bytes).sum())

    def _unique_count(self, record: StepRecord, outcomes: tuple[int, ...]) -> int:
        return int(self._unique_mask(record, outcomes).sum())
