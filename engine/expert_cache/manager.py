"""The expert cache's host side: slot pools and the device tables they are addressed through, the
policies, and the translation of their decisions into table changes (applied by the device at the start
of the next step, `ops.cache_step.begin_step`) and uploads (on the copy stream).

Called between and beside steps, never inside one: `observe` while the next step computes, `changes`
just before a step is launched, `start_uploads` just after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.device import CopyEngine, CopyHandle, LinkCap, bank_shape, empty_bank, expert_parts
from engine.expert_cache.plan import CachePlan
from engine.expert_cache.policy import CachePolicy, Decision, PolicyConfig, Promotion, make_policy
from engine.expert_cache.profile import Profile
from engine.expert_cache.ram_tier import RamTier
from engine.expert_cache.record import LANDED, ON_CPU, StepRecord
from engine.expert_cache.stats import CacheStats
from ops.bank import ExpertWeights
from ops.cache_step import OFFER, PUBLISH, TAIL, UNPUBLISH, SlotTables

Change = tuple[int, int, int, int]


@dataclass
class _Upload:
    handle: CopyHandle
    entries: list[tuple[int, int, int, int]]  # (group, layer, expert, slot), published when the copy is done


class CacheManager:
    def __init__(self, host: Mapping[int, ExpertWeights], plan: CachePlan, cfg: CacheConfig, device: torch.device,
                 rows: Mapping[int, int], num_rows: int, num_experts: int, stats: CacheStats,
                 profile: Profile | None = None, split: tuple[float, float] = (1.0, 0.0),
                 cap: LinkCap | None = None, tier: RamTier | None = None) -> None:
        """tier: the layers of `host` on disk (their banks are the map's views: uploads read through the tier)."""
        self.host, self.plan, self.cfg, self.device, self.rows, self.stats = host, plan, cfg, device, rows, stats
        self.tier = tier
        self.groups = {g.group_id: g for g in plan.groups}
        self.group_of = {layer: g.group_id for g in plan.groups for layer in g.layers}
        self.pools = {g.group_id: empty_bank(host[g.layers[0]], g.num_slots, device) for g in plan.groups
                      if g.is_cached}
        config = PolicyConfig(promote_per_step=cfg.promote_per_step, free_slots=cfg.free_slots)
        self.policies: dict[int, CachePolicy] = {
            gid: make_policy(cfg.policy, self.groups[gid], config, profile, landing=cfg.mode.streams)
            for gid in self.pools}
        self.ring_index = {(gid, r): i for i, (gid, r) in enumerate(
            (gid, r) for gid, p in self.policies.items() for r in range(len(p.rings)))}
        self.no_ring = len(self.ring_index)  # layers of uncached groups: an empty ring, nothing lands
        self.staging = {shape: empty_bank(bank, bank.num_experts, device) for shape, bank in
                        {bank_shape(b): b for b in host.values()}.items()} if device.type == "cuda" and \
            cfg.mode.streams else {}
        self.tables = self._tables(num_rows, num_experts, split)
        self._group_rows = {gid: np.array([rows[x] for x in self.groups[gid].layers]) for gid in self.policies}
        self.published = np.full((num_rows, num_experts), -1, dtype=np.int32)  # what the device has or will have
        self.tail = np.zeros(self.no_ring + 1, dtype=np.int64)
        self.max_changes = 2 * plan.num_slots + 2 * len(self.ring_index) + 64
        self.copies = CopyEngine(device, cap)
        self._changes: dict[tuple, Change] = {}
        self._queued: list[tuple[int, Promotion]] = []  # uploads decided, started after the next launch
        self._uploads: list[_Upload] = []
        self._uploading: dict[tuple[int, int], tuple[int, int]] = {}  # (group, slot) -> (layer, expert)
        self._held_offers: list[tuple[int, int, int]] = []  # (group, ring, slot) offered once its copy is done
        if profile is not None:
            self._warm_start(profile)
        for gid, policy in self.policies.items():
            self._apply(gid, policy.start())

    # -- the device tables ----------------------------------------------------------------------------------
    def _tables(self, num_rows: int, num_experts: int, split: tuple[float, float]) -> SlotTables:
        """split: the hybrid (share, lead) of every layer (`engine.expert_cache.split`)."""
        host = torch.zeros((num_rows, 3, num_experts), dtype=torch.int64)
        staging, pool_base, pool_stride = torch.zeros_like(host), torch.zeros((num_rows, 3), dtype=torch.int64), \
            torch.zeros((num_rows, 3), dtype=torch.int64)
        region = torch.full((num_rows,), self.no_ring, dtype=torch.int32)
        for layer, bank in self.host.items():
            row = self.rows[layer]
            # NOTE: a layer on disk has no host address until a step reads an expert into the RAM tier
            # (`ExpertDispatcher.read_disk_misses`): 0, never the map's, which the device must not read
            if not self._on_disk(layer):
                host[row] = _addresses(bank, num_experts)
            if bank_shape(bank) in self.staging:
                staging[row] = _addresses(self.staging[bank_shape(bank)], num_experts)
            gid = self.group_of.get(layer)
            if gid in self.pools:
                pool = self.pools[gid]
                pool_base[row] = torch.tensor([t.data_ptr() for t in expert_parts(pool, slice(None))])
                pool_stride[row] = torch.tensor([t.stride(0) for t in expert_parts(pool, slice(None))])
                region[row] = self.ring_index[(gid, self.policies[gid].ring_of(layer))]
        capacity = max((len(r.slots) for p in self.policies.values() for r in p.rings), default=1)
        on = lambda t: t.to(self.device)  # noqa: E731
        return SlotTables(
            state=on(torch.full((num_rows, num_experts), -1, dtype=torch.int32)),
            cur=on(torch.zeros((num_rows, 3, num_experts), dtype=torch.int64)), host=on(host), staging=on(staging),
            fill=on(torch.zeros((num_rows, num_experts), dtype=torch.int8)),
            scratch=on(torch.zeros((num_rows, num_experts), dtype=torch.int32)),
            pool_base=on(pool_base), pool_stride=on(pool_stride), region=on(region),
            ring=on(torch.zeros((self.no_ring + 1, max(capacity, 1)), dtype=torch.int32)),
            head=on(torch.zeros(self.no_ring + 1, dtype=torch.int64)),
            tail=on(torch.zeros(self.no_ring + 1, dtype=torch.int64)),
            share=on(torch.full((num_rows,), split[0], dtype=torch.float32)),
            lead=on(torch.full((num_rows,), split[1], dtype=torch.float32)))

    # -- steps ------------------------------------------------------------------------------------------------
    def observe(self, record: StepRecord, upload_cpu_misses: bool = False) -> None:
        """A decode step's uses and landings -> the policies -> changes for the next step (off the critical path).
        `upload_cpu_misses` (hybrid): the experts the CPU computed are promoted by uploads."""
        for gid, policy in self.policies.items():
            rows = self._group_rows[gid]
            ids = record.ids[rows]  # [group layers, pairs], -1 for none
            at, pair = np.nonzero(record.outcome[rows] == LANDED)
            experts, slots = ids[at, pair], record.slot[rows][at, pair]
            _, first = np.unique(at * self.tables.num_experts + experts, return_index=True)  # an expert once
            landed = np.stack([at[first], experts[first], slots[first]], axis=1).astype(np.int64)
            self.published[rows[landed[:, 0]], landed[:, 1]] = landed[:, 2]
            if len(landed):
                self.stats.record_copies(len(landed), 0, 0, gid)
                self._let_go(gid, landed[:, 0], landed[:, 1])
            on_cpu = None
            if upload_cpu_misses:
                at, pair = np.nonzero(record.outcome[rows] == ON_CPU)
                on_cpu = np.unique(np.stack([at, ids[at, pair]], axis=1), axis=0).astype(np.int64)
            self._apply(gid, policy.observe(ids, landed, on_cpu))

    def _let_go(self, gid: int, at: np.ndarray, experts: np.ndarray) -> None:
        """Experts the cache now holds (`at`: the group's layer index): the RAM tier lets disk layers' go first."""
        if self.tier is None:
            return
        layers = self.groups[gid].layers
        for i in np.unique(at).tolist():
            if self._on_disk(layers[i]):
                self.tier.let_go(layers[i], experts[at == i].tolist())

    def reserve(self, num_tokens: int) -> None:
        """Before each decode step: a step with more tokens than the last (a prompt joining) gets offers for
        its misses (`CachePolicy.reserve`), on the changes of that step."""
        for gid, policy in self.policies.items():
            self._apply(gid, policy.reserve(num_tokens))

    def landed(self, record: StepRecord) -> None:
        """Right after a step (before the next one's changes): an expert it landed that an upload queued or in
        flight (hybrid) copies elsewhere is live where it landed (the device publishes landings at the next
        step's start), so that copy is dropped or never published. The policy frees the copy's slot when it
        sees the landing."""
        if not (self._uploading or self._queued) or record.is_prefill:
            return
        rows, pairs = np.nonzero(record.outcome == LANDED)
        if not len(rows):
            return
        layer_of = {row: layer for layer, row in self.rows.items()}
        live = {(layer_of[r], int(record.ids[r, p])) for r, p in zip(rows.tolist(), pairs.tolist())}
        for key, expert in list(self._uploading.items()):
            if expert in live:
                del self._uploading[key]
        self._queued = [(gid, p) for gid, p in self._queued if (p.layer, p.expert) not in live]

    def changes(self) -> list[Change]:
        """The table changes for the next step (publishing finished uploads too); clears them."""
        self._publish_finished()
        if self._held_offers:
            busy = self._copy_targets()
            self._offer([o for o in self._held_offers if (o[0], o[2]) not in busy])
            self._held_offers = [o for o in self._held_offers if (o[0], o[2]) in busy]
        changes, self._changes = list(self._changes.values()), {}
        return changes

    def start_uploads(self) -> None:
        """Start the uploads decided so far; called just after a step's launch, so the copy stream orders
        them after the step whose changes unpublished their slots."""
        queued, self._queued = self._queued, []
        by_group: dict[int, list[Promotion]] = {}
        for gid, promotion in queued:
            by_group.setdefault(gid, []).append(promotion)
        for gid, promotions in by_group.items():
            pool, pairs = self.pools[gid], list[tuple[torch.Tensor, torch.Tensor]]()
            for p in promotions:
                if self._on_disk(p.layer):
                    self._upload_from_disk(pool, p)
                else:
                    pairs += zip(expert_parts(pool, p.slot), expert_parts(self.host[p.layer], p.expert))
                self._uploading[(gid, p.slot)] = (p.layer, p.expert)
            entries = [(gid, p.layer, p.expert, p.slot) for p in promotions]
            self._uploads.append(_Upload(self.copies.copy(pairs), entries))
            self.stats.record_copies(len(promotions), 0, len(promotions) * self.groups[gid].slot_bytes, gid)

    def _on_disk(self, layer: int) -> bool:
        return self.tier is not None and layer in self.tier.layouts

    def _upload_from_disk(self, pool: ExpertWeights, p: Promotion) -> None:
        """A layer on disk's promotion: the expert read into the RAM tier, copied into its slot and waited for.
        NOTE: the step just launched may still read RAM slots (streamed misses), and the RAM slot holds the expert
        only until the next load: the device finishes first, and the copy ends before anything else loads."""
        assert self.tier is not None, "a layer on disk has a tier"
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.copies.copy(list(zip(expert_parts(pool, p.slot), self.tier.expert(p.layer, p.expert)))).wait()
        self.tier.let_go(p.layer, [p.expert])

    def wait_uploads(self) -> None:
        for upload in self._uploads:
            upload.handle.wait()

    # -- decisions -> changes ---------------------------------------------------------------------------------
    def _apply(self, gid: int, decision: Decision) -> None:
        if not decision:
            return
        self._keep_in_ram(gid, decision.evictions)
        for (layer, expert), slot in decision.evictions:
            # NOTE: a slot is unpublished before anything else is copied into it
            row = self.rows[layer]
            self._change(UNPUBLISH, row, expert, 0)
            self.published[row, expert] = -1
            if self._uploading.get((gid, slot)) == (layer, expert):
                del self._uploading[(gid, slot)]
        if self._queued and decision.evictions:
            # NOTE: an upload decided since the last launch (a flush in between) and evicted is dropped, not started
            evicted = {(gid, slot, layer, expert) for (layer, expert), slot in decision.evictions}
            self._queued = [(g, p) for g, p in self._queued if (g, p.slot, p.layer, p.expert) not in evicted]
        # NOTE: a slot an upload still writes (hybrid: one evicted while its copy runs) is offered only once
        # the copy is done, so nothing lands in it before the copy ends
        busy = self._copy_targets() if decision.offers else set()
        self._held_offers += [(gid, ring, slot) for ring, slot in decision.offers if (gid, slot) in busy]
        self._offer([(gid, ring, slot) for ring, slot in decision.offers if (gid, slot) not in busy])
        self._queued += [(gid, p) for p in decision.uploads]
        self.stats.record_copies(0, len(decision.evictions), 0, gid)

    def _keep_in_ram(self, gid: int, evictions: Sequence[tuple[tuple[int, int], int]]) -> None:
        """Evicted experts of layers on disk, as their slots still hold them, go back into the host-RAM tier (the
        tier exclusive of the cache). NOTE: decided while a step runs, before any offer or upload reuses the slots;
        the device is waited for first, as it may read the tier's slots (streamed misses of the running step)."""
        by_layer: dict[int, dict[int, Sequence[torch.Tensor]]] = {}
        for (layer, expert), slot in evictions:
            if self.tier is not None and self._on_disk(layer) and self.published[self.rows[layer], expert] == slot:
                by_layer.setdefault(layer, {})[expert] = expert_parts(self.pools[gid], slot)
        if not by_layer:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for layer, evicted in by_layer.items():  # one batch of device -> host copies a layer, on the copy stream
            self.tier.keep(layer, evicted, lambda pairs: self.copies.copy(pairs).wait())  # type: ignore[union-attr]

    def _offer(self, offers: list[tuple[int, int, int]]) -> None:
        """(group, ring, slot) onto the device's rings, for the device to land misses in."""
        touched = set()
        for gid, ring, slot in offers:
            index = self.ring_index[(gid, ring)]
            self._changes[("ring", index, int(self.tail[index]))] = (OFFER, index, int(self.tail[index]), slot)
            self.tail[index] += 1
            touched.add(index)
        for index in touched:
            self._changes[("tail", index)] = (TAIL, index, int(self.tail[index]), 0)

    def _copy_targets(self) -> set[tuple[int, int]]:
        """(group, slot) of the uploads queued or not yet seen finished."""
        return {(gid, p.slot) for gid, p in self._queued} | \
            {(gid, slot) for upload in self._uploads for gid, _, _, slot in upload.entries}

    def _change(self, kind: int, row: int, expert: int, slot: int) -> None:
        self._changes[("state", row, expert)] = (kind, row, expert, slot)

    def _publish_finished(self, wait: bool = False) -> None:
        # NOTE: a slot is published only after its copy completed, and only if no later decision
        # reassigned it meanwhile.
        still = []
        for upload in self._uploads:
            if not (wait or upload.handle.done()):
                still.append(upload)
                continue
            upload.handle.wait()
            for gid, layer, expert, slot in upload.entries:
                if self._uploading.get((gid, slot)) == (layer, expert):
                    del self._uploading[(gid, slot)]
                    self._change(PUBLISH, self.rows[layer], expert, slot)
                    self.published[self.rows[layer], expert] = slot
        self._uploads = still

    def _warm_start(self, profile: Profile) -> None:
        for gid, policy in self.policies.items():
            self._queued += [(gid, p) for p in policy.warm_start(profile)]
        self.start_uploads()
        self._publish_finished(wait=True)

    # -- introspection ----------------------------------------------------------------------------------------
    def residents(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> slot as the policies hold them (published, uploading or about to be)."""
        return {expert: slot for policy in self.policies.values() for expert, slot in policy.residents().items()}

    def slots_of(self, layer: int) -> list[int]:
        """Published slot (or -1) of each expert of a host layer, as the next step will see them."""
        return self.published[self.rows[layer]].tolist()

    def close(self) -> None:
        self._publish_finished(wait=True)
        self.copies.close()


def _addresses(bank: ExpertWeights, num_experts: int) -> torch.Tensor:
    """int64 `[3, num_experts]`: address of each expert's gate, up and down bytes in the bank."""
    rows = torch.arange(num_experts, dtype=torch.int64)
    return torch.stack([t.data_ptr() + rows * t.stride(0) for t in expert_parts(bank, slice(None))])
