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
from dataclasses import replace

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.cpu_tasks import CpuTasks, CpuWork
from engine.expert_cache.device import LinkCap, bank_shape
from engine.expert_cache.dispatch import ExpertDispatcher, StepTicket
from engine.expert_cache.manager import CacheManager
from engine.expert_cache.observers import CacheObservers
from engine.expert_cache.placement import Placement, choose_placement
from engine.expert_cache.plan import CachePlan, LayerExperts, plan_cache
from engine.expert_cache.profile import Profile
from engine.expert_cache.ram_tier import RamTier, default_host_cache_bytes
from engine.expert_cache.record import StepRecord
from engine.expert_cache.split import Split, measure_link_gbps
from engine.expert_cache.stats import CacheStats, CacheStatsSnapshot
from engine.expert_cache.store import ExpertStore
from ops.grouped_gemm import CHUNK_BYTES

log = logging.getLogger(__name__)


class ExpertCache:
    def __init__(self, dispatcher: ExpertDispatcher, manager: CacheManager, observers: CacheObservers,
                 placement: Placement, plan: CachePlan, cfg: CacheConfig, stats: CacheStats, split: Split,
                 cpu: CpuTasks | None, tier: RamTier | None = None) -> None:
        self.dispatcher, self.manager, self.observers, self.tier = dispatcher, manager, observers, tier
        self.placement, self.plan, self.cfg, self.stats, self.split, self.cpu = \
            placement, plan, cfg, stats, split, cpu
        self._pending: StepRecord | None = None
        self._pending_seconds = 0.0  # the pending record's step, from prepare_step to step_done
        self._began = 0.0  # when the step being launched was prepared
        self._ticket: StepTicket | None = None  # the last step launched
        self._split: tuple[float, float] | None = None  # a new hybrid (share, lead) for the next step

    # -- around each step ---------------------------------------------------------------------------------
    def prepare_step(self, num_tokens: int = 1) -> None:
        self._began = time.monotonic()
        if num_tokens <= self.cfg.max_cached_batch:  # a decode step: its misses land
            self.manager.reserve(num_tokens)
        if self._split is not None:  # between steps: the device reads them in every layer
            self.manager.tables.share.fill_(self._split[0])
            self.manager.tables.lead.fill_(self._split[1])
            self._split = None
        self.dispatcher.prepare(self.manager.changes())

    def launched(self) -> StepTicket:
        self._ticket = replace(self.dispatcher.launched(), began=self._began)
        self.manager.start_uploads()
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
            self.manager.observe(record, upload_cpu_misses=self.split.uploads_cpu_misses)
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
        self.manager.landed(self._pending)
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
    def table_residents(self) -> dict[tuple[int, int], int]:
        """Published (layer, expert) -> slot, as the next step will see them."""
        rows = self.dispatcher.rows
        return {(layer, int(e)): int(self.manager.published[row, e])
                for layer, row in rows.items() if layer in self.placement.host_layers
                for e in np.nonzero(self.manager.published[row] >= 0)[0]}

    def usage_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Recent use `[layers, experts]` (picks, decayed x0.95 per step) and where each expert is now:
        2 resident on the device, 1 cached in a slot, 0 in host RAM only, -2 on disk only (`--ssd-moe`: not in the
        host-RAM tier) (-1: a dense layer)."""
        usage = self.observers.usage
        where = np.full(usage.shape, -1, dtype=np.int8)
        where[list(self.placement.host_layers)] = 0
        where[list(self.placement.resident_layers)] = 2
        for layer in self.placement.host_layers:
            where[layer][self.manager.published[self.dispatcher.rows[layer]] >= 0] = 1
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
        return (f"experts: {p.reason}; {len(p.host_layers)} layers in host RAM, {len(p.resident_layers)} resident; "
                f"cache {plan.cache_bytes / 2**20:.0f} MiB, {plan.num_slots} slots ({plan.share:.1%} of host "
                f"experts), policy {self.cfg.policy}, misses on {self.cfg.miss_mode}{self.split.describe()}"
                + (f"; {self.tier.describe()}" if self.tier is not None else ""))

    def close(self) -> list[str]:
        self.flush()
        self.manager.close()
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
                       num_layers: int, reserved_bytes: int = 0) -> ExpertCache:
    """Place the experts, plan the cache for the budget, and set up its parts over `store`. `max_tokens`:
    the most tokens a step computes (sizes the step record and the CPU job)."""
    hp, device = store.hparams, store.device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if device.type == "cuda":  # prefill: two staged layers and the dequantized chunk; decode: staging banks
        reserved_bytes += 2 * max(store.layer_bytes().values(), default=0) + CHUNK_BYTES
        if cfg.mode.streams:
            reserved_bytes += staging_bytes(store)
    placement = choose_placement(store.layer_bytes(), cfg, free, reserved_bytes)
    layers = [LayerExperts(i, hp.num_experts, hp.top_k, store.expert_bytes(i), bank_shape(store.mapped[i]))
              for i in placement.host_layers]
    plan = plan_cache(layers, placement.budget_bytes)
    for warning in plan.warnings:
        log.warning(warning)
    store.keep_resident(set(placement.resident_layers))
    stats = CacheStats(plan.cache_bytes, plan.num_slots)
    # NOTE: where the device streams a disk layer's misses, a decode step's distinct experts of a layer sit in the
    # tier at once (the kernels read them all in one launch); the CPU reads through it a token at a time
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
    cpu = CpuTasks(host, rows, max_tokens, hp.top_k, hp.hidden, device,
                   cfg.cpu_threads or default_cpu_threads(device), tier) if cfg.mode.uses_cpu and host else None
    cap = link_cap(cfg, device)
    in_ram = [bank for i, bank in host.items() if i not in placement.disk_layers] or \
        (list(tier.banks.values()) if tier is not None else [])  # what hybrid's start-up measurement may read
    split = Split(cfg.mode, device, in_ram[:2], device_path, link_cap_gbps=cfg.link_gbps, cpu=cpu,
                  cached_share=plan.share)
    manager = CacheManager(host, plan, cfg, device, rows, len(moe_layers), hp.num_experts, stats, profile,
                           (split.share, split.lead), cap, tier)
    dispatcher = ExpertDispatcher(host, resident, manager, cfg, device, moe_layers, hp.top_k, max_tokens, cpu,
                                  device_path, cap, tier)
    observers = CacheObservers(stats, plan, moe_layers, list(placement.host_layers),
                               {i: store.expert_bytes(i) for i in placement.host_layers}, num_layers,
                               hp.num_experts, profile=cfg.profile_out is not None)
    return ExpertCache(dispatcher, manager, observers, placement, plan, cfg, stats, split, cpu, tier)


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


def staging_bytes(store: ExpertStore) -> int:
    """VRAM of the staging banks the manager allocates (one bank of every expert, per expert shape)."""
    shapes = {bank_shape(b): b for b in store.mapped.values()}
    return sum(b.num_experts * b.expert_bytes for b in shapes.values())
