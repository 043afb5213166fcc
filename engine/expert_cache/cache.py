"""The expert cache as the engine sees it: a dispatcher the model calls for every MoE layer, a manager
that owns the slots, the policies and the copies, and observers of each step's record. The engine drives
it around each step:

    prepare_step(n)  before the launch of n tokens: the table changes decided so far go to pinned memory
    launched()       just after the launch: the record's copy and the uploads start (ordered after the launched
                     step); returns the step's ticket
    process()        while the step computes: the previous step's record -> observers and policies
    step_done(t)     once the step of ticket t has finished: take its record for the next `process`

A decode step may be launched before the last one is done (`LLMEngine`'s decode ahead) only where the cache
decides nothing (`is_static`: every expert resident, or `cpu` misses with no cache): its table changes and landings
then never depend on the step before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.cpu_tasks import CpuTasks, CpuWork
from engine.expert_cache.device import LinkCap, bank_shape
from engine.expert_cache.dispatch import ExpertDispatcher, StepTicket
from engine.expert_cache.manager import CacheManager
from engine.expert_cache.observers import CacheObservers
from engine.expert_cache.pipeline import PipelineDispatcher
from engine.expert_cache.placement import Placement, merge_placements, place_on_devices
from engine.expert_cache.plan import CachePlan, LayerExperts, merge_plans, plan_devices
from engine.expert_cache.profile import Profile
from engine.expert_cache.ram_tier import RamTier, default_host_cache_bytes
from engine.expert_cache.record import StepRecord
from engine.expert_cache.split import Split, measure_link_gbps
from engine.expert_cache.stats import CacheStats, CacheStatsSnapshot, DeviceShare
from engine.expert_cache.store import ExpertStore
from engine.layer_split import LayerSplit
from ops.bank import ExpertWeights
from ops.grouped_gemm import CHUNK_BYTES

log = logging.getLogger(__name__)


class ExpertCache:
    def __init__(self, dispatcher: ExpertDispatcher | PipelineDispatcher, managers: Sequence[CacheManager],
                 observers: CacheObservers, placement: Placement, plan: CachePlan, cfg: CacheConfig, stats: CacheStats,
                 split: Split, cpu: CpuTasks | None, tier: RamTier | None = None) -> None:
        """managers: one a device (a split model: each over its own layers)."""
        self.dispatcher, self.managers, self.observers, self.tier = dispatcher, tuple(managers), observers, tier
        self.placement, self.plan, self.cfg, self.stats, self.split, self.cpu = \
            placement, plan, cfg, stats, split, cpu
        self._pending: StepRecord | None = None
        self._pending_seconds = 0.0  # the pending record's step, from prepare_step to step_done
        self._began = 0.0  # when the step being launched was prepared
        self._ticket: StepTicket | None = None  # the last step launched
        self._split: tuple[float, float] | None = None  # a new hybrid (share, lead) for the next step

    @property
    def manager(self) -> CacheManager:
        """The device's cache manager (a split model's first device's: `managers` holds each device's)."""
        return self.managers[0]

    # -- around each step ---------------------------------------------------------------------------------
    def prepare_step(self, num_tokens: int = 1) -> None:
        self._began = time.monotonic()
        for manager in self.managers:
            if num_tokens <= self.cfg.max_cached_batch:  # a decode step: its misses land
                manager.reserve(num_tokens)
            if self._split is not None:  # between steps: the device reads them in every layer
                manager.tables.share.fill_(self._split[0])
                manager.tables.lead.fill_(self._split[1])
        self._split = None
        self.dispatcher.prepare()

    def launched(self) -> StepTicket:
        self._ticket = replace(self.dispatcher.launched(), began=self._began)
        for manager in self.managers:
            manager.start_uploads()
        return self._ticket

    def process(self) -> None:
        """The previous step's record: observers, then (decode steps) the policies. Off the critical path."""
        record, self._pending = self._pending, None
        if record is None:
            return
        streamed = self.observers.observe(record)
        if not record.is_prefill:  # NOTE: prefill never changes the cache
            # the link's load over decode steps' own time: not the prompts or the idle time between them
            self.split.link.add(streamed, self._pending_seconds)
            for manager in self.managers:
                manager.observe(record, upload_cpu_misses=self.split.uploads_cpu_misses)
            if self.cpu is not None:
                seconds = self._pending_seconds / max(record.num_tokens, 1)
                self._split = self.split.update(self.cpu.work(), seconds, record.num_tokens) or self._split

    def step_done(self, ticket: StepTicket | None = None) -> StepRecord:
        """Take a finished step's record (the last step launched unless `ticket` names another), to be processed
        while the next step runs."""
        ticket = ticket or self._ticket
        assert ticket is not None, "step_done before any launch"
        self.process()  # a record not processed yet (no step ran meanwhile) goes first
        self._pending, self._pending_seconds = self.dispatcher.take_record(ticket), time.monotonic() - ticket.began
        for manager in self.managers:
            manager.landed(self._pending)
        return self._pending

    @property
    def is_static(self) -> bool:
        """No step changes a table or lands an expert: every routed expert resident, or every host layer's experts
        computed by the CPU with no slot to cache them in (`cpu` misses, no cache, no disk tier)."""
        no_cache = not self.cfg.mode.streams and self.plan.num_slots == 0 and self.tier is None
        return not self.dispatcher.host or no_cache

    def flush(self) -> None:
        """Process what is pending (the engine is idle: stats complete)."""
        self.process()

    # -- introspection ----------------------------------------------------------------------------------
    def published(self) -> np.ndarray:
        """The slot (or -1) of every (MoE row, expert) as the next step will see it, on whichever device holds it
        (each row is one device's)."""
        if len(self.managers) == 1:
            return self.manager.published
        return np.maximum.reduce([m.published for m in self.managers])

    def table_residents(self) -> dict[tuple[int, int], int]:
        """Published (layer, expert) -> slot (in its device's pool), as the next step will see them."""
        rows, published = self.dispatcher.rows, self.published()
        return {(layer, int(e)): int(published[row, e])
                for layer, row in rows.items() if layer in self.placement.host_layers
                for e in np.nonzero(published[row] >= 0)[0]}

    def usage_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Recent use `[layers, experts]` (picks, decayed x0.95 per step) and where each expert is now:
        2 resident on the device, 1 cached in a slot, 0 in host RAM only, -2 on disk only (`--ssd-moe`: not in the
        host-RAM tier) (-1: a dense layer)."""
        usage = self.observers.usage
        where = np.full(usage.shape, -1, dtype=np.int8)
        where[list(self.placement.host_layers)] = 0
        where[list(self.placement.resident_layers)] = 2
        published = self.published()
        for layer in self.placement.host_layers:
            where[layer][published[self.dispatcher.rows[layer]] >= 0] = 1
        if self.tier is not None:
            in_ram = set(self.tier.lru.residents())
            for layer in self.tier.layouts:
                where[layer][[(layer, e) not in in_ram and w == 0 for e, w in enumerate(where[layer])]] = -2
        return usage.copy(), where

    def snapshot(self) -> CacheStatsSnapshot:
        work = self.cpu_work()
        return replace(self.stats.snapshot(), cpu_seconds=work.busy_seconds, cpu_bytes=work.bytes)

    def cpu_work(self) -> CpuWork:
        return self.cpu.work() if self.cpu is not None else CpuWork()

    def describe(self) -> str:
        p, plan = self.placement, self.plan
        if not p.host_layers:
            return f"experts: {p.reason}"
        devices = self.stats.devices if len(self.stats.devices) > 1 else ()
        return (f"experts: {p.reason}; {len(p.host_layers)} layers in host RAM, {len(p.resident_layers)} resident; "
                f"cache {plan.cache_bytes / 2**20:.0f} MiB, {plan.num_slots} slots ({plan.share:.1%} of host "
                f"experts)" + "".join(f", {d.device} {d.cache_bytes / 2**20:.1f} MiB" for d in devices)
                + f", policy {self.cfg.policy}, misses on {self.cfg.miss_mode}{self.split.describe()}"
                + (f"; {self.tier.describe()}" if self.tier is not None else ""))

    def close(self) -> list[str]:
        self.flush()
        for manager in self.managers:
            manager.close()
        if self.cpu is not None:
            self.cpu.close()
        if self.tier is not None:
            self.tier.close()
        if self.observers.profile is not None and self.cfg.profile_out:
            self.observers.profile.save(self.cfg.profile_out)
        return self.stats.summary_lines()


def default_cpu_threads(device: torch.device) -> int:
    """Threads of the CPU expert kernel: with a GPU, leave two cores to the thread that launches GPU
    work and to the CUDA runtime (an oversubscribed team stalls on its slowest thread: 5x slower
    measured on the H200 host)."""
    cores = os.cpu_count() or 1
    return max(1, cores - 2) if device.type == "cuda" and cores > 4 else cores


def on_device(device: torch.device) -> bool:
    """The expert path runs the Triton kernels (CUDA with Triton); else torch references and CPU kernels."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def build_expert_cache(store: ExpertStore, cfg: CacheConfig, max_tokens: int, moe_layers: list[int],
                       num_layers: int, reserved_bytes: Sequence[int] = (), layer_split: LayerSplit | None = None
                       ) -> ExpertCache:
    """Place the experts, plan the cache for the budget, and set up its parts over `store`. `max_tokens`:
    the most tokens a step computes (sizes the step record and the CPU job). `reserved_bytes`: device memory each
    device keeps for other things (its KV cache). `layer_split`: the layers' devices where they are several: each
    device places its own layers' experts and has its own cache of them (`PipelineDispatcher`)."""
    hp = store.hparams
    devices = [torch.device(d) for d in layer_split.devices] if layer_split is not None else [store.device]
    labels = layer_split.labels if layer_split is not None else (str(store.device),)
    ranges = layer_split.ranges if layer_split is not None else (range(num_layers),)
    parts = [[x for x in moe_layers if x in r] for r in ranges]
    rooms = [device_room(store, cfg, d, part, reserved) for d, part, reserved in
             zip(devices, parts, list(reserved_bytes) or [0] * len(devices), strict=True)]
    placements = place_on_devices(store.layer_bytes(), cfg, parts, *zip(*rooms, strict=True))
    placement = merge_placements(placements, labels)
    plans = plan_devices([host_experts(store, p.host_layers) for p in placements], [p.budget_bytes for p in placements],
                         labels)
    plan = merge_plans(plans)
    for warning in plan.warnings:
        log.warning(warning)
    store.keep_resident(set(placement.resident_layers))
    stats = CacheStats(plan.cache_bytes, plan.num_slots, devices=[
        DeviceShare(label, tuple(g.group_id for g in p.groups), p.cache_bytes, p.num_slots)
        for label, p in zip(labels, plans, strict=True)])
    # NOTE: where the device streams a disk layer's misses, a decode step's distinct experts of a layer sit in the
    # tier at once (the kernels read them all in one launch); the CPU reads through it a token at a time
    device = devices[0]
    device_path = on_device(device)
    at_once = min(hp.num_experts, hp.top_k * min(max_tokens, cfg.max_cached_batch)) \
        if device_path and cfg.mode.streams else hp.top_k
    tier = store.disk_tier(placement.disk_layers, host_cache_bytes(cfg), at_once, stats) \
        if placement.disk_layers else None
    # NOTE: a disk layer's bank is the map's view (shapes, types, addresses): its bytes are read through the tier
    host = {i: store.mapped[i] if i in placement.disk_layers else store.host(i) for i in placement.host_layers}
    resident = {i: store.resident(i) for i in placement.resident_layers}
    profile = Profile.load(cfg.profile_in) if cfg.profile_in else None
    rows = {layer: i for i, layer in enumerate(moe_layers)}
    # NOTE: the CPU computes the misses of every device's layers, each task after a host sync where there are several
    cpu = CpuTasks(host, rows, max_tokens, hp.top_k, hp.hidden, device, cfg.cpu_threads or default_cpu_threads(device),
                   tier, rings=len(devices) == 1) if cfg.mode.uses_cpu and host else None
    caps = [link_cap(cfg, on) for on in devices]
    in_ram = [bank for i, bank in host.items() if i not in placement.disk_layers] or \
        (list(tier.banks.values()) if tier is not None else [])  # what hybrid's start-up measurement may read
    split = Split(cfg.mode, device, in_ram[:2], device_path, link_cap_gbps=cfg.link_gbps, cpu=cpu,
                  cached_share=plan.share)
    managers: list[CacheManager] = []
    dispatchers: list[ExpertDispatcher] = []
    for on, part, part_plan, cap in zip(devices, placements, plans, caps, strict=True):
        part_host = {i: host[i] for i in part.host_layers}
        managers.append(CacheManager(part_host, part_plan, cfg, on, rows, len(moe_layers), hp.num_experts, stats,
                                     profile, (split.share, split.lead), cap, tier))
        dispatchers.append(ExpertDispatcher(part_host, {i: resident[i] for i in part.resident_layers}, managers[-1],
                                            cfg, on, moe_layers, hp.top_k, max_tokens, cpu, device_path, cap, tier))
    observers = CacheObservers(stats, plan, moe_layers, list(placement.host_layers),
                               {i: store.expert_bytes(i) for i in placement.host_layers}, num_layers,
                               hp.num_experts, profile=cfg.profile_out is not None)
    dispatcher = dispatchers[0] if len(dispatchers) == 1 else PipelineDispatcher(dispatchers)
    return ExpertCache(dispatcher, managers, observers, placement, plan, cfg, stats, split, cpu, tier)


def device_room(store: ExpertStore, cfg: CacheConfig, device: torch.device, layers: Sequence[int],
                reserved_bytes: int) -> tuple[int | None, int]:
    """A device's free memory (None: the CPU) and what it must keep for other things than its layers' experts:
    `reserved_bytes` and, on CUDA, the prefill's two staged layers and dequantized chunk, and (streamed misses) the
    staging banks."""
    if device.type != "cuda":
        return None, reserved_bytes
    layer_bytes = store.layer_bytes()
    reserved_bytes += 2 * max((layer_bytes[i] for i in layers), default=0) + CHUNK_BYTES
    if cfg.mode.streams:
        reserved_bytes += staging_bytes([store.mapped[i] for i in layers])
    return torch.cuda.mem_get_info(device)[0], reserved_bytes


def host_experts(store: ExpertStore, layers: Sequence[int]) -> list[LayerExperts]:
    """The cache plan's view of the layers whose experts live in host RAM."""
    hp = store.hparams
    return [LayerExperts(i, hp.num_experts, hp.top_k, store.expert_bytes(i), bank_shape(store.mapped[i]))
            for i in layers]


def host_cache_bytes(cfg: CacheConfig) -> int:
    """The host-RAM tier's size: `--host-cache-mib`, else half the available RAM at start-up."""
    return cfg.host_cache_mib * 2**20 if cfg.host_cache_mib is not None else default_host_cache_bytes()


def link_cap(cfg: CacheConfig, device: torch.device) -> LinkCap | None:
    """The simulated slower link of `--link-gbps` (a CUDA device's: the CPU has no host link)."""
    if cfg.link_gbps is None:
        return None
    if device.type != "cuda":
        raise ValueError("--link-gbps simulates a slower host -> device link: it needs a CUDA device")
    return LinkCap(cfg.link_gbps, measure_link_gbps(device))


def staging_bytes(banks: Sequence[ExpertWeights]) -> int:
    """VRAM of the staging banks a manager allocates for these layers' banks (one bank of every expert, per expert
    shape)."""
    shapes = {bank_shape(b): b for b in banks}
    return sum(b.num_experts * b.expert_bytes for b in shapes.values())
