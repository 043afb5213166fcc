"""The expert executor the model calls for every MoE layer: splits a step's (token, expert) pairs into
cache hits (computed on the device from slots) and misses (computed on the CPU from host RAM, or read
by the device from host memory), so every pair is computed exactly once; then, between steps, feeds
the routing to the policy and runs its promotions off the critical path."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.compute import TableCompute, make_compute, staging_bytes
from engine.expert_cache.device import CopyEngine, PendingCopy, SlotTable, bank_shape, empty_bank, expert_parts
from engine.expert_cache.placement import Placement, choose_placement
from engine.expert_cache.plan import CachePlan, LayerExperts, plan_cache
from engine.expert_cache.policy import CachePolicy, PolicyConfig, Promotion, make_policy
from engine.expert_cache.profile import Profile
from engine.expert_cache.split import MissSplit, measure_split
from engine.expert_cache.staging import LayerStager
from engine.expert_cache.stats import CacheStats, CacheStatsSnapshot
from engine.expert_cache.store import ExpertStore
from engine.moe import flatten_pairs
from engine.weights import expert_bytes
from ops.cpu_experts import ExpertWeights, expert_ffn_cpu
from ops.grouped_gemm import CHUNK_BYTES, grouped_gemm_available, grouped_gemm_ffn

log = logging.getLogger(__name__)

USAGE_DECAY = 0.95  # per step: the usage heatmap shows roughly the last 20 steps


@dataclass(frozen=True)
class LayerRecord:
    """How one step routed one layer, kept on the device until the step ends."""

    layer: int
    expert_ids: torch.Tensor  # [pairs]
    slots: torch.Tensor  # [pairs], -1 for a miss
    on_device: torch.Tensor  # [pairs], the expert id where the device computed the pair, else -1
    resident: bool = False  # a layer resident on the device: counted in usage only


class ExpertCache:
    def __init__(self, host: dict[int, ExpertWeights], resident: dict[int, ExpertWeights], placement: Placement,
                 plan: CachePlan, cfg: CacheConfig, device: torch.device, num_layers: int, num_experts: int,
                 profile: Profile | None = None) -> None:
        self.host, self.resident, self.placement, self.plan, self.cfg = host, resident, placement, plan, cfg
        self.device = device
        self.groups = {g.group_id: g for g in plan.groups}
        self.group_of = {layer: g.group_id for g in plan.groups for layer in g.layers}
        self.pools = {g.group_id: empty_bank(host[g.layers[0]], g.num_slots, device)
                      for g in plan.groups if g.is_cached}
        self.table = SlotTable(num_layers, num_experts, device)
        self.compute = make_compute(host, resident, self.pools, self.group_of, device,
                                    stage_misses=cfg.miss_mode != "cpu")
        self.split: MissSplit = measure_split(cfg.miss_mode, device, next(iter(host.values()), None),
                                              zero_copy=isinstance(self.compute, TableCompute))
        self.expert_bytes = {layer: expert_bytes(bank) for layer, bank in host.items()}
        pc = PolicyConfig(promote_per_step=cfg.promote_per_step)
        self.policies: dict[int, CachePolicy] = {
            gid: make_policy(cfg.policy, self.groups[gid], pc, profile) for gid in self.pools}
        self.copies = CopyEngine(device)
        # large batches on tensor cores (CUDA): host layers staged whole, double-buffered
        self.stager = LayerStager(host, self.pools, self.group_of, self.table, self.copies) \
            if isinstance(self.compute, TableCompute) and grouped_gemm_available(device) else None
        self.cpu = ThreadPoolExecutor(1, thread_name_prefix="moecache-cpu-experts")
        self.cpu_threads = cfg.cpu_threads or default_cpu_threads(device)

        self.stats = CacheStats(plan.cache_bytes, plan.num_slots)
        self.profile = Profile() if cfg.profile_out else None
        self.usage = np.zeros((num_layers, num_experts), dtype=np.float32)  # recent picks, decayed per step
        self.recording = cfg.record_trace is not None
        self.last_routing: np.ndarray | None = None  # [moe_layers, tokens, top_k] of the last step, if recording
        self._routed: list[torch.Tensor] = []
        self._records: list[LayerRecord] = []
        self._step_tokens = 0
        self._pending: list[PendingCopy] = []
        self._in_flight: dict[tuple[int, int], tuple[int, int]] = {}  # (group, slot) -> (layer, expert)
        if profile is not None:
            for gid, policy in self.policies.items():
                self._promote(gid, policy.warm_start(profile))

    # -- the step: called by the model for every MoE layer ------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        tokens, experts, pair_weights = flatten_pairs(expert_ids, weights)
        if self.recording:
            self._routed.append(expert_ids)
        self._step_tokens = x.shape[0]
        if x.shape[0] > self.cfg.max_cached_batch and self.stager is not None:
            return self._prefill(layer, x, expert_ids, weights, experts)
        if layer in self.resident:
            self._records.append(LayerRecord(layer, experts, experts, experts, resident=True))
            return self.compute.resident_ffn(layer, x, tokens, experts, pair_weights).to(x.dtype)
        slots = self.table.lookup(layer, experts) if self.group_of[layer] in self.pools else \
            torch.full_like(experts, -1)
        on_device, cpu = self._split(layer, x, tokens, experts, slots, pair_weights)
        self._records.append(LayerRecord(layer, experts, slots, on_device))
        # NOTE: exactly once: the device computes the pairs in `on_device`, the CPU the others, at once.
        if cpu is not None and cpu.has_every_pair:
            return cpu.result().to(x.dtype)
        out = self.compute.ffn(layer, x, tokens, on_device, slots, pair_weights)  # launched before the CPU wait
        return (out if cpu is None else out + cpu.result()).to(x.dtype)

    def _prefill(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
        """A large batch: the layer's experts resident or staged whole in VRAM, one grouped GEMM per
        projection. The cache is read (staging copies cached experts from their slots), never changed."""
        if layer in self.resident:
            self._records.append(LayerRecord(layer, experts, experts, experts, resident=True))
            return grouped_gemm_ffn(x, expert_ids, weights, self.resident[layer]).to(x.dtype)
        slots = self.table.lookup(layer, experts)
        self._records.append(LayerRecord(layer, experts, slots, experts))
        assert self.stager is not None, "large batches are staged only where the stager exists"
        bank = self.stager.bank(layer)
        out = grouped_gemm_ffn(x, expert_ids, weights, bank)
        self.stager.release(bank)
        return out.to(x.dtype)

    def _split(self, layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
               slots: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, _CpuPart | None]:
        """Which pairs the device computes (their expert id; -1 elsewhere), and the CPU's share."""
        if x.shape[0] > self.cfg.max_cached_batch or self.cfg.miss_mode == "stream":
            return experts, None  # the device reads every miss from host memory: no host sync
        # NOTE: cpu and hybrid modes read the routing on the host: one sync per layer.
        host = torch.stack([tokens, experts, slots]).cpu()
        miss = host[2] < 0
        to_stream = self.split.streamed(host[1][miss]) if self.cfg.miss_mode == "hybrid" else host[1][:0]
        on_cpu = miss & ~torch.isin(host[1], to_stream)
        on_device = torch.where(on_cpu.to(experts.device), -1, experts)
        if not bool(on_cpu.any()):
            return on_device, None
        future = self.cpu.submit(expert_ffn_cpu, x.float().cpu(), host[0][on_cpu], host[1][on_cpu],
                                 weights.cpu()[on_cpu], self.host[layer], num_threads=self.cpu_threads)
        return on_device, _CpuPart(future, x.device, has_every_pair=bool(on_cpu.all()))

    @property
    def is_graph_safe(self) -> bool:
        """A decode step makes no host sync (so it can be captured): pointer-table compute, and misses
        read by the device rather than the CPU; not while recording a trace (recorded in Python)."""
        host_sync = bool(self.host) and self.cfg.miss_mode != "stream"
        return isinstance(self.compute, TableCompute) and not host_sync and not self.recording

    def discard_step(self) -> list[LayerRecord]:
        """Drop what the last forward recorded (a warm-up or capture run); returns its records."""
        records, self._records, self._routed = self._records, [], []
        return records

    def restore_step(self, records: list[LayerRecord], num_tokens: int) -> None:
        """A replayed graph ran `records` again (its static tensors hold this step's routing)."""
        self._records, self._step_tokens = list(records), num_tokens

    # -- between steps ----------------------------------------------------------------------------
    def end_step(self) -> None:
        """Stats, policy and promotions for the step just computed; publish finished copies."""
        if self._records:
            self._account(self._records, self._step_tokens)
        if self._routed:
            self.last_routing = torch.stack(self._routed).cpu().numpy()
        self._records, self._routed = [], []
        if self.stager is not None:
            self.stager.discard()
        self._publish_done()

    def _account(self, records: list[LayerRecord], num_tokens: int) -> None:
        # NOTE: one device -> host copy for the whole step, after it was computed.
        cached = [r for r in records if not r.resident]
        parts = [r.expert_ids for r in records] + [r.slots for r in cached] + [r.on_device for r in cached]
        flat = torch.cat(parts).cpu().numpy()
        sizes = np.array([r.expert_ids.numel() for r in records])
        total = int(sizes.sum())
        ids, layers = flat[:total], np.repeat([r.layer for r in records], sizes)
        valid = ids >= 0  # padding rows of a captured batch route nowhere
        self._count_usage(layers[valid], ids[valid])
        if not cached:
            return
        in_cache = np.repeat([not r.resident for r in records], sizes)
        keep = valid[in_cache]
        slots, on_device = flat[total:].reshape(2, -1)[:, keep]
        experts, layers = ids[in_cache][keep], layers[in_cache][keep]
        miss = slots < 0
        hits, misses = {}, {}
        for gid in {self.group_of[r.layer] for r in cached}:
            in_group = np.isin(layers, self.groups[gid].layers)
            hits[gid], misses[gid] = int((in_group & ~miss).sum()), int((in_group & miss).sum())
        streamed = self._unique_experts(layers, experts, miss & (on_device >= 0))
        on_cpu = self._unique_experts(layers, experts, miss & (on_device < 0))
        streamed_bytes = sum(self.expert_bytes[layer] for layer, _ in streamed)
        self.stats.record_step(num_tokens, hits, misses, streamed_bytes, len(on_cpu))
        self._observe({r.layer: experts[layers == r.layer] for r in cached}, num_tokens)

    def _count_usage(self, layers: np.ndarray, experts: np.ndarray) -> None:
        self.usage *= USAGE_DECAY
        cells = np.bincount(layers * self.usage.shape[1] + experts, minlength=self.usage.size)
        self.usage += cells.reshape(self.usage.shape).astype(np.float32)

    @staticmethod
    def _unique_experts(layers: np.ndarray, experts: np.ndarray, mask: np.ndarray) -> set[tuple[int, int]]:
        return set(zip(layers[mask].tolist(), experts[mask].tolist()))

    def _observe(self, by_layer: dict[int, np.ndarray], num_tokens: int) -> None:
        if self.profile is not None:
            for layer, ids in by_layer.items():
                self.profile.add(layer, ids.tolist())
        if num_tokens > self.cfg.max_cached_batch:
            return  # NOTE: prefill never evicts the decode working set
        for gid, policy in self.policies.items():
            used = {layer: by_layer[layer].tolist() for layer in self.groups[gid].layers if layer in by_layer}
            self._promote(gid, policy.observe(used))

    def _promote(self, gid: int, promotions: list[Promotion]) -> None:
        if not promotions:
            return
        # NOTE: a slot is unpublished before its copy starts.
        self._set_table([(*p.evicted, -1) for p in promotions if p.evicted] +
                        [(p.layer, p.expert, -1) for p in promotions])
        pool = self.pools[gid]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in promotions:
            copies += zip(expert_parts(pool, p.slot), expert_parts(self.host[p.layer], p.expert))
            self._in_flight[(gid, p.slot)] = (p.layer, p.expert)
        entries = [(gid, p.layer, p.expert, p.slot) for p in promotions]
        self._pending.append(PendingCopy(self.copies.copy(copies), entries))
        evictions = sum(p.evicted is not None for p in promotions)
        self.stats.record_copies(len(promotions), evictions, len(promotions) * self.groups[gid].slot_bytes)

    def _publish_done(self, wait: bool = False) -> None:
        # NOTE: a slot is published only after its copy completed, and only if no later promotion
        # reassigned it meanwhile.
        done = [wait or p.handle.done() for p in self._pending]
        ready = [p for p, d in zip(self._pending, done) if d]
        self._pending = [p for p, d in zip(self._pending, done) if not d]
        publish = []
        for pending in ready:
            pending.handle.wait()
            for gid, layer, expert, slot in pending.entries:
                if self._in_flight.get((gid, slot)) == (layer, expert):
                    del self._in_flight[(gid, slot)]
                    publish.append((layer, expert, slot))
        self._set_table(publish)

    def _set_table(self, entries: list[tuple[int, int, int]]) -> None:
        """(layer, expert, slot or -1). NOTE: called only between steps."""
        self.table.set(entries)
        self.compute.update(entries)

    # -- introspection ----------------------------------------------------------------------------
    def table_residents(self) -> dict[tuple[int, int], int]:
        """Published (layer, expert) -> slot, as the next step will see them."""
        return {(layer, expert): int(self.table.host[layer, expert])
                for layer, expert in (self.table.host >= 0).nonzero().tolist()}

    def usage_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Recent use `[layers, experts]` (picks, decayed x0.95 per step) and where each expert is now:
        2 resident on the device, 1 cached in a slot, 0 in host RAM only (-1: a dense layer)."""
        where = np.full(self.usage.shape, -1, dtype=np.int8)
        where[list(self.host)] = 0
        where[list(self.resident)] = 2
        where[self.table.host.numpy() >= 0] = 1
        return self.usage.copy(), where

    def snapshot(self) -> CacheStatsSnapshot:
        return self.stats.snapshot()

    def describe(self) -> str:
        p, plan = self.placement, self.plan
        if not p.host_layers:
            return f"experts: {p.reason}"
        return (f"experts: {p.reason}; {len(p.host_layers)} layers in host RAM, {len(p.resident_layers)} resident; "
                f"cache {plan.cache_bytes / 2**20:.0f} MiB, {plan.num_slots} slots ({plan.share:.1%} of host "
                f"experts), policy {self.cfg.policy}, misses on {self.cfg.miss_mode}")

    def close(self) -> list[str]:
        self._publish_done(wait=True)
        self.copies.close()
        self.cpu.shutdown(wait=True)
        if self.profile is not None and self.cfg.profile_out:
            self.profile.save(self.cfg.profile_out)
        return self.stats.summary_lines()


def default_cpu_threads(device: torch.device) -> int:
    """Threads of the CPU expert kernel: with a GPU, leave two cores to the thread that launches GPU
    work and to the CUDA runtime (an oversubscribed team stalls on its slowest thread: 5x slower
    measured on the H200 host)."""
    cores = os.cpu_count() or 1
    return max(1, cores - 2) if device.type == "cuda" and cores > 4 else cores


class _CpuPart:
    """Misses computed by the CPU thread pool: a Future of a host tensor."""

    def __init__(self, future: Future, device: torch.device, has_every_pair: bool) -> None:
        self.future, self.device = future, device
        self.has_every_pair = has_every_pair  # nothing left for the device: skip its launches

    def result(self) -> torch.Tensor:
        return self.future.result().to(self.device, non_blocking=True)


def build_expert_cache(store: ExpertStore, cfg: CacheConfig, reserved_bytes: int = 0) -> ExpertCache:
    """Place the experts, plan the cache for the budget, and set up the executor over `store`."""
    hp, device = store.hparams, store.device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if device.type == "cuda":  # prefill: two staged layers and the dequantized chunk; decode: staging banks
        reserved_bytes += 2 * max(store.layer_bytes().values(), default=0) + CHUNK_BYTES
        if cfg.miss_mode != "cpu":
            reserved_bytes += staging_bytes(store.mapped.values())
    placement = choose_placement(store.layer_bytes(), cfg, free, reserved_bytes)
    layers = [LayerExperts(i, hp.num_experts, hp.top_k, store.expert_bytes(i), bank_shape(store.mapped[i]))
              for i in placement.host_layers]
    plan = plan_cache(layers, placement.budget_bytes)
    for warning in plan.warnings:
        log.warning(warning)
    store.keep_resident(set(placement.resident_layers))
    host = {i: store.host(i) for i in placement.host_layers}
    resident = {i: store.resident(i) for i in placement.resident_layers}
    profile = Profile.load(cfg.profile_in) if cfg.profile_in else None
    return ExpertCache(host, resident, placement, plan, cfg, device, hp.num_layers, hp.num_experts, profile)

