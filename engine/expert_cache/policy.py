"""Expert-cache policies: which experts hold the slots of one cached group (torch-free).

Slots are grouped in rings: one ring of all the group's slots (`lru`, `decay`, `static`), or one per layer
(`lfru`). Where misses are streamed by the device (stream and hybrid miss modes) the policy
*offers* free slots of each ring, and the device lands a missed expert in an offered slot as it copies
it for the step (`ops.cache_step`): the copy that computes the miss is the promotion, so an expert
crosses PCIe once. After each step the engine calls `observe` with the experts each layer selected
and the landings of the step; the policy takes the landed experts in, updates its scores, and
evicts the least valuable experts so that each ring again has free slots to offer (about twice its
recent misses a step: decisions apply a step late). Where misses are computed by the CPU (cpu miss
mode) nothing lands: the policy picks misses to *upload* on the copy stream instead, at most
`promote_per_step` a step for the scored policies.

- `lru`: one pool shared by the group's layers; every miss is taken in, the least recently used out.
- `decay`: one pool shared by the group's layers (a layer that routes widely holds more slots); a score decays
  per token, +1 per use; the lowest scores of the whole pool are evicted, so a
  landed expert stays only if it outscores the weakest resident.
- `lfru`: per-layer slots; use counts halved periodically; a landed expert stays only if it is
  clearly hotter (`lfru_margin`) than the resident it would replace.
- `static`: the most used experts of a profile, fixed; nothing is offered.

An expert is `(layer, expert)`. The state is numpy arrays (a step costs a few vectorized operations,
whatever the number of slots): the slot of each expert, the expert of each slot, which slots are
offered. It counts decisions the device has not applied yet (an evicted expert is gone, an upload in
flight holds its slot), so no slot is ever given twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.profile import Profile

Expert = tuple[int, int]  # (layer, expert)
EMA = 0.8  # per step: the recent misses a ring sizes its offered slots by
RESERVE = 4  # offered slots before a larger step, per recent miss per token and token of the step
PROFILE_TOKENS = 8  # lfru: the tokens of use a warm-start profile's rates are seeded as


@dataclass(frozen=True)
class Promotion:
    """Upload (layer, expert) into `slot`; `evicted` held the slot until now."""

    slot: int
    layer: int
    expert: int
    evicted: Expert | None


@dataclass(frozen=True)
class PolicyConfig:
    promote_per_step: int = 8  # uploads a step of the scored policies where misses do not land
    decay: float = 0.93  # replaying bench's requests: 82.4% hits at 25% (0.9: 82.0%), level with lru at 50%
    lfru_halve_every: int = 128
    lfru_margin: float = 2.0
    free_slots: int = 0  # offered slots a ring keeps; 0: twice its recent misses a step (none without misses)

    def __post_init__(self) -> None:
        if self.promote_per_step < 1 or self.lfru_halve_every < 1 or self.free_slots < 0:
            raise ValueError("promote_per_step and lfru_halve_every must be >= 1, free_slots >= 0")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if self.lfru_margin < 1.0:
            raise ValueError(f"lfru_margin must be >= 1, got {self.lfru_margin}")


@dataclass(frozen=True)
class Ring:
    """Slots whose free ones the layers' misses land in."""

    slots: range
    layers: tuple[int, ...]


@dataclass
class Decision:
    """What the engine applies for a policy at the start of the next step."""

    evictions: list[tuple[Expert, int]] = field(default_factory=list)  # unpublish; the slot is then free
    offers: list[tuple[int, int]] = field(default_factory=list)  # (ring, slot) for the device to land in
    uploads: list[Promotion] = field(default_factory=list)  # copy host -> slot, publish when done

    def __bool__(self) -> bool:
        return bool(self.evictions or self.offers or self.uploads)


def layer_slots(group: GroupPlan) -> dict[int, range]:
    """Per-layer split of the group's slots: even, one extra for each of the first `remainder` layers."""
    base, extra = divmod(group.num_slots, len(group.layers))
    bounds = np.cumsum([0] + [base + (i < extra) for i in range(len(group.layers))])
    return {layer: range(bounds[i], bounds[i + 1]) for i, layer in enumerate(group.layers)}


@dataclass(frozen=True)
class StepUse:
    """One step of a group, vectorized: each distinct (layer, expert) it used, with its use count."""

    rows: np.ndarray  # [n] int64: the layer's position in the group
    experts: np.ndarray  # [n] int64
    counts: np.ndarray  # [n] int64
    num_tokens: np.ndarray  # [layers] int64: tokens of the step at each layer (0: not in the step)


class CachePolicy(ABC):
    """One instance per cached group; slots are numbered 0..group.num_slots-1. `landing`: the device
    lands streamed misses in offered slots (else misses are uploaded by the policy's choice)."""

    name: ClassVar[str]
    needs_profile: ClassVar[bool] = False
    offers_slots: ClassVar[bool] = True
    shared_ring: ClassVar[bool] = False  # one ring of all slots (else one per layer)

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        self.group, self.config, self.landing = group, config, landing
        self.row = {layer: i for i, layer in enumerate(group.layers)}
        n, e = len(group.layers), group.num_experts
        self.slot = np.full((n, e), -1, dtype=np.int64)  # [layers, experts]: slot, or -1
        self.owner = np.full(group.num_slots, -1, dtype=np.int64)  # [slots]: row * experts + expert, or -1
        self.is_offered = np.zeros(group.num_slots, dtype=bool)
        self.rings = ([Ring(range(group.num_slots), group.layers)] if self.shared_ring else
                      [Ring(slots, (layer,)) for layer, slots in layer_slots(group).items()])
        self.ring_of_row = np.array([0 if self.shared_ring else i for i in range(n)], dtype=np.int64)
        self.ring_of_slot = np.zeros(group.num_slots, dtype=np.int64)
        for i, r in enumerate(self.rings):
            self.ring_of_slot[r.slots.start:r.slots.stop] = i
        self._misses = np.zeros(len(self.rings))  # recent missed experts a step, per ring
        self._token_misses = np.zeros(len(self.rings))  # the same per token of the step
        self._last_tokens = 1  # tokens of the last step `reserve` was told of

    # -- state ----------------------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int | None:
        slot = int(self.slot[self.row[layer], expert])
        return slot if slot >= 0 else None

    def residents(self) -> dict[Expert, int]:
        rows, experts = np.nonzero(self.slot >= 0)
        return {(self.group.layers[r], int(e)): int(self.slot[r, e]) for r, e in zip(rows, experts)}

    def offered(self, ring: int) -> frozenset[int]:
        r = self.rings[ring].slots
        return frozenset((np.nonzero(self.is_offered[r.start:r.stop])[0] + r.start).tolist())

    def ring_of(self, layer: int) -> int:
        return int(self.ring_of_row[self.row[layer]])

    def _expert(self, key: int) -> Expert:
        return self.group.layers[key // self.group.num_experts], key % self.group.num_experts

    # -- the protocol -----------------------------------------------------------------------------------
    def start(self) -> Decision:
        """Offer every free slot (after any warm start)."""
        decision = Decision()
        if self.landing and self.offers_slots:
            self._offer(decision, np.nonzero(self.owner < 0)[0])
        return decision

    def observe(self, used: Mapping[int, Sequence[int] | np.ndarray] | np.ndarray,
                landed: Mapping[Expert, int] | np.ndarray | None = None,
                on_cpu: np.ndarray | None = None) -> Decision:
        """One step: the ids each layer's tokens selected (layer -> ids, one per (token, k); or an array
        `[layers of the group, pairs]`, -1 for none), the experts the device landed in offered slots
        (expert -> slot; or an array `[n, 3]` of (layer position in the group, expert, slot)), and, where
        misses land, those the CPU computed instead (hybrid: `[n, 2]` of (layer position, expert)), which
        are admitted by uploads as in a mode where nothing lands (they never crossed the link). Returns what
        to apply before the next step."""
        step = self._step_use(used)
        decision = Decision()
        landed_keys = self._take_landings({} if landed is None else landed, decision)
        self._count_misses(step, landed_keys)
        self._update(step, landed_keys)
        if self.landing:
            if self.offers_slots:
                self._refill(decision, self._targets(), landed_keys)
            if on_cpu is not None and len(on_cpu):
                self._admit(decision, self._only(step, on_cpu))
        else:
            self._admit(decision, step)
        return decision

    def reserve(self, num_tokens: int) -> Decision:
        """Before each decode step, of `num_tokens` (applied at once, between steps): a step of more tokens
        than the last gets each ring offering at least `RESERVE` x its recent misses per token x
        `num_tokens`, so a prompt's misses land too (a new request misses more than the last one did, and
        refills follow a step late). Nothing where misses do not land."""
        decision, larger = Decision(), num_tokens > self._last_tokens
        self._last_tokens = num_tokens
        if larger and self.landing and self.offers_slots:
            wanted = np.ceil(RESERVE * self._token_misses * num_tokens - 0.1).astype(np.int64)
            self._refill(decision, np.maximum(self._targets(), self._capped(wanted)), np.zeros(0, np.int64))
        return decision

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Upload each ring's best experts of `profile` (`_warm_order`) into its free slots."""
        self.check_profile(profile)
        promotions: list[Promotion] = []
        for ring in self.rings:
            free = [s for s in ring.slots if self.owner[s] < 0]
            wanted = [x for x in self._warm_order(ring, profile) if self.slot_of(*x) is None]
            promotions += [self._place(s, x) for s, x in zip(free, wanted, strict=False)]
        return promotions

    def _warm_order(self, ring: Ring, profile: Profile) -> list[Expert]:
        """The ring's experts a warm start takes, best first: the profile's most used."""
        return profile.top(ring.layers, len(ring.slots))

    def check_profile(self, profile: Profile) -> None:
        """Raises ValueError if `profile` names experts this group does not have."""
        for layer in self.group.layers:
            bad = [e for e in profile.layer_counts(layer) if e >= self.group.num_experts]
            if bad:
                raise ValueError(
                    f"profile names experts {bad} of layer {layer}, which has {self.group.num_experts}"
                )

    # -- hooks of the policies --------------------------------------------------------------------------
    @abstractmethod
    def _update(self, step: StepUse, landed: np.ndarray) -> None:
        """Recency or scores after a step; `landed`: keys (row * experts + expert) of its landings."""

    @abstractmethod
    def _victims(self, counts: np.ndarray, landed: np.ndarray) -> np.ndarray:
        """Up to `counts[ring]` slots of held experts of each ring to evict, least valuable first."""

    @abstractmethod
    def _admit(self, decision: Decision, step: StepUse) -> None:
        """Where misses do not land: uploads (and the evictions they need)."""

    # -- shared mechanics -------------------------------------------------------------------------------
    def _step_use(self, used: Mapping[int, Sequence[int] | np.ndarray] | np.ndarray) -> StepUse:
        num_experts = self.group.num_experts
        if not isinstance(used, np.ndarray):
            for layer in used:
                if layer not in self.row:
                    raise ValueError(f"layer {layer} is not in group {self.group.group_id}")
            width = max((len(ids) for ids in used.values()), default=0)
            table = np.full((len(self.group.layers), width), -1, dtype=np.int64)
            for layer, layer_ids in used.items():
                ids = np.asarray(layer_ids, dtype=np.int64)
                if ids.size and not 0 <= ids.min():
                    raise ValueError(f"layer {layer}: expert ids {ids.tolist()} outside [0, {num_experts})")
                table[self.row[layer], :len(ids)] = ids
            used = table
        if used.size and used.max() >= num_experts:
            raise ValueError(f"expert ids {np.unique(used[used >= num_experts]).tolist()} outside "
                             f"[0, {num_experts})")
        valid = used >= 0
        keys = (np.arange(used.shape[0])[:, None] * num_experts + used)[valid]
        unique, counts = np.unique(keys, return_counts=True)
        tokens = -(-valid.sum(axis=1) // self.group.top_k)  # ceil
        return StepUse(unique // num_experts, unique % num_experts, counts, tokens)

    def _only(self, step: StepUse, experts: np.ndarray) -> StepUse:
        """The step's uses of `experts` `[n, 2]` (layer position in the group, expert) alone."""
        keys = step.rows * self.group.num_experts + step.experts
        wanted = np.isin(keys, experts[:, 0].astype(np.int64) * self.group.num_experts + experts[:, 1])
        return StepUse(step.rows[wanted], step.experts[wanted], step.counts[wanted], step.num_tokens)

    def _targets(self) -> np.ndarray:
        """Offered slots each ring keeps `[rings]`: twice its recent misses, at most a quarter of it."""
        wanted = np.full(len(self.rings), self.config.free_slots) if self.config.free_slots else \
            np.ceil(2 * self._misses - 0.1).astype(np.int64)
        return self._capped(wanted)

    def _capped(self, wanted: np.ndarray) -> np.ndarray:
        """Offered slots per ring `[rings]` at most a quarter of the ring."""
        return np.minimum(wanted, np.maximum(np.array([len(r.slots) for r in self.rings]) // 4, 1))

    def _take_landings(self, landed: Mapping[Expert, int] | np.ndarray, decision: Decision) -> np.ndarray:
        """The landed experts take their slots; returns their keys (row * experts + expert)."""
        if not isinstance(landed, np.ndarray):
            landed = np.array([(self.row[layer], e, slot) for (layer, e), slot in landed.items()],
                              dtype=np.int64).reshape(-1, 3)
        rows, experts, slots = landed.T
        bad = (slots < 0) | (slots >= self.group.num_slots)
        bad[~bad] = ~self.is_offered[slots[~bad]]
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise ValueError(f"{(self.group.layers[rows[i]], int(experts[i]))} landed in slot {int(slots[i])}, "
                             f"which was not offered")
        self.is_offered[slots] = False
        # NOTE: an expert held elsewhere by an upload not yet published (hybrid) missed and landed: the landing,
        # published by the device, wins; the upload's slot is freed (the engine offers it once its copy is done)
        again = self.slot[rows, experts] >= 0
        if again.any():
            old = self.slot[rows[again], experts[again]]
            self.owner[old] = -1
            self._offer(decision, old)
        keys = rows * self.group.num_experts + experts
        # NOTE: a slot holds at most one expert and an expert at most one slot (offered slots are free)
        self.owner[slots], self.slot[rows, experts] = keys, slots
        return keys

    def _count_misses(self, step: StepUse, landed: np.ndarray) -> None:
        keys = step.rows * self.group.num_experts + step.experts
        missed = (self.slot[step.rows, step.experts] < 0) | np.isin(keys, landed)
        per_ring = np.bincount(self.ring_of_row[step.rows[missed]], minlength=len(self.rings))
        self._misses = EMA * self._misses + (1 - EMA) * per_ring
        self._token_misses = EMA * self._token_misses + (1 - EMA) * per_ring / max(int(step.num_tokens.max()), 1)

    def _refill(self, decision: Decision, targets: np.ndarray, landed: np.ndarray) -> None:
        """Offer free slots, then evicted ones, until each ring offers `targets[ring]`."""
        rings = len(self.rings)
        deficit = targets - np.bincount(self.ring_of_slot[self.is_offered], minlength=rings)
        if (deficit <= 0).all():
            return
        free = self.first_per_ring(np.nonzero((self.owner < 0) & ~self.is_offered)[0], deficit)
        self._offer(decision, free)
        deficit -= np.bincount(self.ring_of_slot[free], minlength=rings)
        if (deficit > 0).any():
            slots = self._victims(np.maximum(deficit, 0), landed)
            self._evict(slots, decision)
            self._offer(decision, slots)

    def first_per_ring(self, slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The first `counts[ring]` of `slots` (grouped by ring, in order) of each ring."""
        rings = self.ring_of_slot[slots]
        rank = np.arange(len(slots)) - np.searchsorted(rings, rings, side="left")
        return slots[rank < counts[rings]]

    def _offer(self, decision: Decision, slots: np.ndarray) -> None:
        # NOTE: an offered slot is free: no expert is published in it until a landing
        assert not (self.owner[slots] >= 0).any() and not self.is_offered[slots].any(), "slot offered twice"
        self.is_offered[slots] = True
        decision.offers += zip(self.ring_of_slot[slots].tolist(), slots.tolist())

    def _evict(self, slots: np.ndarray, decision: Decision) -> None:
        keys = self.owner[slots]
        self.slot.flat[keys] = -1
        self.owner[slots] = -1
        layers = np.asarray(self.group.layers)[keys // self.group.num_experts]
        decision.evictions += zip(zip(layers.tolist(), (keys % self.group.num_experts).tolist()), slots.tolist())

    def _place(self, slot: int, expert: Expert) -> Promotion:
        # NOTE: a slot holds at most one expert and an expert at most one slot.
        old = int(self.owner[slot])
        evicted = self._expert(old) if old >= 0 else None
        if evicted is not None:
            self.slot[self.row[evicted[0]], evicted[1]] = -1
        row = self.row[expert[0]]
        self.owner[slot], self.slot[row, expert[1]] = row * self.group.num_experts + expert[1], slot
        return Promotion(slot, expert[0], expert[1], evicted)


class LruPolicy(CachePolicy):
    name = "lru"
    shared_ring = True

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self.last_used = np.zeros(group.num_slots, dtype=np.int64)  # [slots]: step of the last use
        self._clock = 0

    def _update(self, step: StepUse, landed: np.ndarray) -> None:
        self._clock += 1
        slots = self.slot[step.rows, step.experts]
        self.last_used[slots[slots >= 0]] = self._clock

    def _victims(self, counts: np.ndarray, landed: np.ndarray) -> np.ndarray:
        # NOTE: an expert used in the step is never evicted for it (its last use is this step)
        count = int(counts[0])
        held = np.nonzero(self.owner >= 0)[0]
        held = held[self.last_used[held] < self._clock]
        if len(held) > count:
            held = held[np.argpartition(self.last_used[held], count - 1)[:count]]
        return held[np.argsort(self.last_used[held], kind="stable")]

    def _admit(self, decision: Decision, step: StepUse) -> None:
        missed = np.nonzero(self.slot[step.rows, step.experts] < 0)[0]
        missed = missed[np.argsort(-step.counts[missed], kind="stable")]  # most used in the step first
        # NOTE: free slots that are not offered, then the least recent experts not used in the step
        # (`_victims`): no expert used in the step is evicted, no offered slot is taken
        free = np.nonzero((self.owner < 0) & ~self.is_offered)[0]
        need = len(missed) - len(free)
        victims = self._victims(np.array([need]), np.zeros(0, np.int64)) if need > 0 else free[:0]
        for i, slot in zip(missed.tolist(), np.concatenate([free, victims]).tolist()):  # the first misses
            promotion = self._place(slot, (self.group.layers[step.rows[i]], int(step.experts[i])))
            if promotion.evicted is not None:
                decision.evictions.append((promotion.evicted, slot))
            decision.uploads.append(promotion)
            self.last_used[slot] = self._clock

    def warm_start(self, profile: Profile) -> list[Promotion]:
        promotions = super().warm_start(profile)
        hottest = profile.top(self.group.layers, self.group.num_slots)
        for rank, expert in enumerate(reversed(hottest)):  # the hottest becomes the most recent
            slot = self.slot_of(*expert)
            if slot is not None:
                self.last_used[slot] = rank - len(hottest)
        return promotions


class ScoredPolicy(CachePolicy):
    """Per-layer slots ranked by a score per expert; subclasses say how scores move and compare."""

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self.scores = np.zeros((len(group.layers), group.num_experts))  # [layers, experts]

    def score(self, layer: int, expert: int) -> float:
        return float(self.scores[self.row[layer], expert])

    @abstractmethod
    def _update_scores(self, uses: np.ndarray, num_tokens: np.ndarray) -> None:
        """Scores `[layers, experts]` in place after a step with `uses` `[layers, experts]` of
        `num_tokens` `[layers]` tokens (0: the layer was not in the step)."""

    @abstractmethod
    def _margin(self) -> float:
        """How many times hotter than a resident a newcomer must be to replace it."""

    def _beats(self, candidate: np.ndarray, resident: np.ndarray) -> np.ndarray:
        return candidate > self._margin() * resident

    @abstractmethod
    def _seed_scale(self) -> float:
        """Score of an expert used once per token, at one token per step (the warm-start unit)."""

    def _update(self, step: StepUse, landed: np.ndarray) -> None:
        uses = np.zeros(self.scores.shape)
        uses[step.rows, step.experts] = step.counts
        self._update_scores(uses, step.num_tokens)

    def _victims(self, counts: np.ndarray, landed: np.ndarray) -> np.ndarray:
        """The lowest-scored held experts of each ring; a just-landed expert stays only if it beats the
        resident it would replace (`_margin`): valued at score / margin, it goes first on a tie."""
        held = np.nonzero(self.owner >= 0)[0]
        keys = self.owner[held]
        is_new = np.isin(keys, landed)
        value = self.scores.flat[keys] / np.where(is_new, self._margin(), 1.0)
        order = np.lexsort((~is_new, value, self.ring_of_slot[held]))  # by ring, then value, new first
        return self.first_per_ring(held[order], counts)

    def _admit(self, decision: Decision, step: StepUse) -> None:
        num_experts = self.group.num_experts
        keys = step.rows * num_experts + step.experts
        missed = keys[self.slot.flat[keys] < 0]
        ring_of = self.ring_of_row[missed // num_experts]
        offers: list[tuple[bool, float, int, Expert]] = []
        for ring in np.unique(ring_of).tolist():
            offers += self._upload_offers(ring, missed[ring_of == ring])
        # NOTE: empty slots first, then the largest gains; a ring's offers are distinct slots.
        offers.sort(key=lambda o: (o[0], o[1]))
        for _, _, slot, expert in offers[: self.config.promote_per_step]:
            promotion = self._place(slot, expert)
            if promotion.evicted is not None:
                decision.evictions.append((promotion.evicted, slot))
            decision.uploads.append(promotion)

    def _upload_offers(self, ring: int, missed: np.ndarray) -> list[tuple[bool, float, int, Expert]]:
        """(is_replacement, key, slot, expert) for the ring's missed experts (row * experts + expert), best
        first: the hottest misses against the weakest residents of the ring."""
        scores, num_experts = self.scores.reshape(-1), self.group.num_experts
        missed = missed[np.lexsort((missed, -scores[missed]))]
        r = self.rings[ring].slots
        slots = np.arange(r.start, r.stop)
        slots = slots[~self.is_offered[slots]]  # NOTE: an offered slot is the device's to land in
        owners = self.owner[slots]
        resident_scores = np.where(owners >= 0, scores[np.maximum(owners, 0)], 0.0)
        weakest = slots[np.lexsort((slots, resident_scores, owners >= 0))]
        offers: list[tuple[bool, float, int, Expert]] = []
        for key, slot in zip(missed.tolist(), weakest.tolist(), strict=False):
            expert, old = (self.group.layers[key // num_experts], key % num_experts), int(self.owner[slot])
            if old < 0:
                offers.append((False, -float(scores[key]), slot, expert))
            elif self._beats(scores[key:key + 1], scores[old:old + 1])[0]:
                offers.append((True, float(scores[old] - scores[key]), slot, expert))
            else:
                break
        return offers

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Seeds each layer's scores with the profile's uses per token, then fills each ring's free slots with its
        highest-scored experts."""
        self.check_profile(profile)
        for layer in self.group.layers:
            counts = profile.layer_counts(layer)
            num_tokens = sum(counts.values()) / self.group.top_k
            if num_tokens > 0:
                self.scores[self.row[layer]] = 0.0
                for expert, n in counts.items():
                    self.scores[self.row[layer], expert] = n / num_tokens * self._seed_scale()
        return super().warm_start(profile)

    def _warm_order(self, ring: Ring, profile: Profile) -> list[Expert]:
        """By seeded score: uses per token, whatever the tokens each layer's profile counts."""
        scores, num_experts = self.scores.reshape(-1), self.group.num_experts
        rows = np.array([self.row[layer] for layer in ring.layers], dtype=np.int64)
        keys = (rows[:, None] * num_experts + np.arange(num_experts)).reshape(-1)
        keys = keys[scores[keys] > 0]
        keys = keys[np.lexsort((keys, -scores[keys]))]
        return [(self.group.layers[k // num_experts], k % num_experts) for k in keys.tolist()]


class DecayPolicy(ScoredPolicy):
    name = "decay"
    shared_ring = True  # replaying bench's requests: 82.4% hits at 25% and 95.9% at 50%, per-layer 81.5% and 93.7%

    def _update_scores(self, uses: np.ndarray, num_tokens: np.ndarray) -> None:
        self.scores *= (self.config.decay ** num_tokens)[:, None]
        self.scores += uses

    def _margin(self) -> float:
        return 1.0

    def _seed_scale(self) -> float:
        return 1.0 / (1.0 - self.config.decay)  # steady state of s <- decay * s + 1


class LfruPolicy(ScoredPolicy):
    name = "lfru"

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self._steps = 0

    def _update_scores(self, uses: np.ndarray, num_tokens: np.ndarray) -> None:
        if self._steps and self._steps % self.config.lfru_halve_every == 0:
            self.scores *= 0.5
        self._steps += 1
        self.scores += uses

    def _margin(self) -> float:
        return self.config.lfru_margin

    def _seed_scale(self) -> float:
        # NOTE: a profile is another workload's uses: seeded as PROFILE_TOKENS tokens of use (not a whole halving
        # period, which the running requests' own experts must then beat twice over before they stay)
        return float(PROFILE_TOKENS)


class StaticPolicy(CachePolicy):
    """The most used experts of a profile, filled by `warm_start`, then fixed: nothing is offered,
    evicted or uploaded, so every miss is streamed or computed by the CPU."""

    name = "static"
    needs_profile = True
    offers_slots = False
    shared_ring = True

    def _update(self, step: StepUse, landed: np.ndarray) -> None:
        pass

    def _victims(self, counts: np.ndarray, landed: np.ndarray) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def _admit(self, decision: Decision, step: StepUse) -> None:
        pass


_POLICY_TYPES: dict[str, type[CachePolicy]] = {
    cls.name: cls for cls in (LruPolicy, DecayPolicy, LfruPolicy, StaticPolicy)
}
POLICIES: tuple[str, ...] = tuple(_POLICY_TYPES)


def make_policy(name: str, group: GroupPlan, config: PolicyConfig, profile: Profile | None = None,
                landing: bool = True) -> CachePolicy:
    """An empty policy for `group`. The caller warm-starts it (`warm_start(profile)`) and uploads the
    returned promotions, then applies `start()`; `profile` is checked here so a missing or mismatched
    one fails at startup."""
    if name not in _POLICY_TYPES:
        raise ValueError(f"unknown cache policy {name!r}; one of {', '.join(POLICIES)}")
    policy = _POLICY_TYPES[name](group, config, landing)
    if policy.needs_profile and profile is None:
        raise ValueError(f"{name} policy needs --cache-profile")
    if profile is not None:
        policy.check_profile(profile)
    return policy
