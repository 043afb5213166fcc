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

    def observe(self, record: StepRecord) -> int:
        """Counts the step; returns the bytes its misses streamed over the host link."""
        self._count_usage(record)
        if self.profile is not None:
            for row, layer in enumerate(self.moe_layers):
                ids = record.ids[row]
                self.profile.add(layer, ids[ids >= 0].tolist())
        return self._count_cache(record) if len(self.host_rows) else 0

    def _count_usage(self, record: StepRecord) -> None:
        self.usage *= USAGE_DECAY
        valid = record.ids >= 0
        layers = np.broadcast_to(np.array(self.moe_layers)[:, None], record.ids.shape)[valid]
        cells = np.bincount(layers * self.usage.shape[1] + record.ids[valid], minlength=self.usage.size)
        self.usage += cells.reshape(self.usage.shape).astype(np.float32)

    def _count_cache(self, record: StepRecord) -> int:
        hits, misses = {}, {}
        for gid, rows in self.group_rows.items():
            counts = np.bincount(record.outcome[rows].ravel() + 1, minlength=ON_CPU + 2)  # PAD .. ON_CPU
            hits[gid] = int(counts[HIT + 1])
            misses[gid] = int(counts[STAGED + 1] + counts[LANDED + 1] + counts[ON_CPU + 1])
        # each distinct (layer, expert) once: its bytes crossed once (streamed) or were read by the CPU once
        outcome, ids = record.outcome[self.host_rows], record.ids[self.host_rows]
        keys = self.host_rows[:, None] * self.usage.shape[1] + ids
        streamed = np.unique(keys[(outcome == STAGED) | (outcome == LANDED)])
        on_cpu = np.unique(keys[outcome == ON_CPU])
        streamed_bytes = int(self.row_bytes[streamed // self.usage.shape[1]].sum())
        self.stats.record_step(record.num_tokens, hits, misses, streamed_bytes, len(on_cpu))
        return streamed_bytes
