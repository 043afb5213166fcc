"""Expert-cache policies: which experts hold the slots of one cached group (torch-free).

Slots are grouped in rings: one ring of all the group's slots (`lru`), or one per layer (`decay`,
`lfru`, `static`). Where misses are streamed by the device (stream and hybrid miss modes) the policy
*offers* free slots of each ring, and the device lands a missed expert in an offered slot as it copies
it for the step (`ops.cache_step`): the copy that computes the miss is the promotion, so an expert
crosses PCIe once. After each step the engine calls `observe` with the experts each layer selected
and the landings of the step; the policy takes the landed experts in, updates its scores, and
evicts the least valuable experts so that each ring again has free slots to offer. Where misses are
computed by the CPU (cpu miss mode) nothing lands: the policy picks misses to *upload* on the copy
stream instead, at most `promote_per_step` a step for the scored policies.

- `lru`: one pool shared by the group's layers; every miss is taken in, the least recently used out.
- `decay`: per-layer slots; a score decays per token, +1 per use; the lowest scores are evicted, so a
  landed expert stays only if it outscores the weakest resident.
- `lfru`: per-layer slots; use counts halved periodically; a landed expert stays only if it is
  clearly hotter (`lfru_margin`) than the resident it would replace.
- `static`: the most used experts of a profile, fixed; nothing is offered.

An expert is `(layer, expert)`. The policy's state counts decisions the device has not applied yet
(an evicted expert is gone, an upload in flight holds its slot), so no slot is ever given twice.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.profile import Profile

Expert = tuple[int, int]  # (layer, expert)
EMA = 0.8  # per step: the recent misses a ring sizes its offered slots by


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
    decay: float = 0.9
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


class CachePolicy(ABC):
    """One instance per cached group; slots are numbered 0..group.num_slots-1. `landing`: the device
    lands streamed misses in offered slots (else misses are uploaded by the policy's choice)."""

    name: ClassVar[str]
    needs_profile: ClassVar[bool] = False

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        self.group, self.config, self.landing = group, config, landing
        self._layers = frozenset(group.layers)
        self._held: list[Expert | None] = [None] * group.num_slots  # slot -> expert (published or uploading)
        self._slot: dict[Expert, int] = {}  # expert -> slot
        self.rings = self._make_rings()
        self._ring_of_layer = {layer: i for i, r in enumerate(self.rings) for layer in r.layers}
        self._ring_of_slot = {s: i for i, r in enumerate(self.rings) for s in r.slots}
        self._offered: list[set[int]] = [set() for _ in self.rings]
        self._misses = [0.0] * len(self.rings)  # recent missed experts a step, per ring

    def _make_rings(self) -> list[Ring]:
        return [Ring(slots, (layer,)) for layer, slots in layer_slots(self.group).items()]

    # -- state ----------------------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._slot.get((layer, expert))

    def residents(self) -> dict[Expert, int]:
        return dict(self._slot)

    def offered(self, ring: int) -> frozenset[int]:
        return frozenset(self._offered[ring])

    def ring_of(self, layer: int) -> int:
        return self._ring_of_layer[layer]

    # -- the protocol -----------------------------------------------------------------------------------
    def start(self) -> Decision:
        """Offer every free slot (after any warm start)."""
        decision = Decision()
        if self.landing and self.offers_slots:
            for ring, r in enumerate(self.rings):
                self._offer(decision, ring, [s for s in r.slots if self._held[s] is None])
        return decision

    def observe(self, used: Mapping[int, Sequence[int]], landed: Mapping[Expert, int] | None = None) -> Decision:
        """One step: layer -> ids its tokens selected (one per (token, k)), and the experts the device
        landed in offered slots -> slot. Returns what to apply before the next step."""
        ids = self._used_ids(used)
        decision = Decision()
        self._take_landings(landed or {}, decision)
        self._count_misses(ids, landed or {})
        self._update(ids)
        if self.landing:
            if self.offers_slots:
                self._refill(decision, ids)
        else:
            self._admit(decision, ids)
        return decision

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Upload each ring's most used experts of `profile` into its free slots."""
        self.check_profile(profile)
        promotions: list[Promotion] = []
        for ring in self.rings:
            free = [s for s in ring.slots if self._held[s] is None]
            wanted = [e for e in profile.top(ring.layers, len(ring.slots)) if e not in self._slot]
            promotions += [self._place(s, e) for s, e in zip(free, wanted, strict=False)]
        return promotions

    def check_profile(self, profile: Profile) -> None:
        """Raises ValueError if `profile` names experts this group does not have."""
        for layer in self.group.layers:
            bad = [e for e in profile.layer_counts(layer) if e >= self.group.num_experts]
            if bad:
                raise ValueError(
                    f"profile names experts {bad} of layer {layer}, which has {self.group.num_experts}"
                )

    # -- hooks of the policies --------------------------------------------------------------------------
    offers_slots: ClassVar[bool] = True

    @abstractmethod
    def _update(self, used: dict[int, list[int]]) -> None:
        """Recency or scores after a step."""

    @abstractmethod
    def _victims(self, ring: int, count: int, used: dict[int, list[int]]) -> list[Expert]:
        """Up to `count` held experts of the ring to evict, least valuable first."""

    @abstractmethod
    def _admit(self, decision: Decision, used: dict[int, list[int]]) -> None:
        """Where misses do not land: uploads (and the evictions they need)."""

    def _on_landing(self, expert: Expert) -> None:
        """An expert just took a slot (landed)."""

    # -- shared mechanics -------------------------------------------------------------------------------
    def _target(self, ring: int) -> int:
        size = len(self.rings[ring].slots)
        wanted = self.config.free_slots or math.ceil(2 * self._misses[ring] - 0.1)
        return min(wanted, max(size // 4, 1))

    def _take_landings(self, landed: Mapping[Expert, int], decision: Decision) -> None:
        for expert, slot in landed.items():
            ring = self._ring_of_slot.get(slot)
            if ring is None or slot not in self._offered[ring]:
                raise ValueError(f"{expert} landed in slot {slot}, which was not offered")
            self._offered[ring].discard(slot)
            if expert in self._slot:  # already held elsewhere: give the slot back
                self._offer(decision, ring, [slot])
                continue
            self._place(slot, expert)
            self._on_landing(expert)

    def _count_misses(self, used: dict[int, list[int]], landed: Mapping[Expert, int]) -> None:
        step = Counter[int]()
        for layer, ids in used.items():
            step[self._ring_of_layer[layer]] += len({e for e in ids if (layer, e) not in self._slot
                                                     or (layer, e) in landed})
        for ring in range(len(self.rings)):
            self._misses[ring] = EMA * self._misses[ring] + (1 - EMA) * step[ring]

    def _refill(self, decision: Decision, used: dict[int, list[int]]) -> None:
        for ring in range(len(self.rings)):
            deficit = self._target(ring) - len(self._offered[ring])
            free = [s for s in self.rings[ring].slots if self._held[s] is None and s not in self._offered[ring]]
            now = free[:max(deficit, 0)]
            self._offer(decision, ring, now)
            deficit -= len(now)
            if deficit > 0:
                for expert in self._victims(ring, deficit, used):
                    slot = self._evict(expert, decision)
                    self._offer(decision, ring, [slot])

    def _offer(self, decision: Decision, ring: int, slots: Sequence[int]) -> None:
        for slot in slots:
            # NOTE: an offered slot is free: no expert is published in it until a landing
            assert self._held[slot] is None and slot not in self._offered[ring], f"slot {slot} offered twice"
            self._offered[ring].add(slot)
            decision.offers.append((ring, slot))

    def _evict(self, expert: Expert, decision: Decision) -> int:
        slot = self._slot.pop(expert)
        self._held[slot] = None
        decision.evictions.append((expert, slot))
        return slot

    def _place(self, slot: int, expert: Expert) -> Promotion:
        # NOTE: a slot holds at most one expert and an expert at most one slot.
        evicted = self._held[slot]
        if evicted is not None:
            del self._slot[evicted]
        self._held[slot] = expert
        self._slot[expert] = slot
        return Promotion(slot, expert[0], expert[1], evicted)

    def _free_slot(self, slots: range) -> int | None:
        return next((s for s in slots if self._held[s] is None and s not in self._offered[self._ring_of_slot[s]]),
                    None)

    def _used_ids(self, used: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, layer_ids in used.items():
            ids = layer_ids.tolist() if isinstance(layer_ids, np.ndarray) else [int(e) for e in layer_ids]
            if layer not in self._layers:
                raise ValueError(f"layer {layer} is not in group {self.group.group_id}")
            if ids and not 0 <= min(ids) <= max(ids) < self.group.num_experts:
                raise ValueError(f"layer {layer}: expert ids {ids} outside [0, {self.group.num_experts})")
            out[layer] = ids
        return out


class LruPolicy(CachePolicy):
    name = "lru"

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self._recency: OrderedDict[Expert, None] = OrderedDict()  # least recently used first

    def _make_rings(self) -> list[Ring]:
        return [Ring(range(self.group.num_slots), self.group.layers)]

    def _update(self, used: dict[int, list[int]]) -> None:
        for layer, ids in used.items():
            for e in ids:
                if (layer, e) in self._recency:
                    self._recency.move_to_end((layer, e))

    def _on_landing(self, expert: Expert) -> None:
        self._recency[expert] = None

    def _victims(self, ring: int, count: int, used: dict[int, list[int]]) -> list[Expert]:
        # NOTE: an expert used in the step is never evicted for it.
        in_step = {(layer, e) for layer, ids in used.items() for e in ids}
        victims = []
        for expert in self._recency:
            if len(victims) == count:
                break
            if expert not in in_step:
                victims.append(expert)
        return victims

    def _evict(self, expert: Expert, decision: Decision) -> int:
        del self._recency[expert]
        return super()._evict(expert, decision)

    def _admit(self, decision: Decision, used: dict[int, list[int]]) -> None:
        uses = Counter((layer, e) for layer, ids in used.items() for e in ids)
        hits = [e for e in uses if e in self._slot]
        # NOTE: room excludes this step's hits, so no expert used in the step is evicted.
        room = max(self.group.num_slots - len(hits), 0)
        misses = sorted((e for e in uses if e not in self._slot), key=uses.__getitem__, reverse=True)
        for expert in misses[:room]:
            slot = self._free_slot(range(self.group.num_slots))
            if slot is None:
                slot = self._slot[next(iter(self._recency))]
                del self._recency[self._held[slot]]  # type: ignore[index]
            promotion = self._place(slot, expert)
            if promotion.evicted is not None:
                decision.evictions.append((promotion.evicted, slot))
            decision.uploads.append(promotion)
            self._recency[expert] = None

    def warm_start(self, profile: Profile) -> list[Promotion]:
        promotions = super().warm_start(profile)
        for p in promotions:
            self._recency[(p.layer, p.expert)] = None
        for expert in reversed(profile.top(self.group.layers, self.group.num_slots)):
            if expert in self._recency:
                self._recency.move_to_end(expert)  # the hottest becomes the most recent
        return promotions


class ScoredPolicy(CachePolicy):
    """Per-layer slots ranked by a score per expert; subclasses say how scores move and compare."""

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self._scores = {layer: np.zeros(group.num_experts) for layer in group.layers}  # [num_experts]
        self._landed: set[Expert] = set()  # landed in the step being observed

    def score(self, layer: int, expert: int) -> float:
        return float(self._scores[layer][expert])

    @abstractmethod
    def _update_scores(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        """Scores `[num_experts]` in place after a step with `uses [num_experts]` of `num_tokens`."""

    @abstractmethod
    def _beats(self, candidate: float, resident: float) -> bool: ...

    @abstractmethod
    def _seed_scale(self) -> float:
        """Score of an expert used once per token, at one token per step (the warm-start unit)."""

    def _start_step(self) -> None:
        """Hook run before a step's scores are updated."""

    def observe(self, used: Mapping[int, Sequence[int]], landed: Mapping[Expert, int] | None = None) -> Decision:
        self._landed = set(landed or {})
        try:
            return super().observe(used, landed)
        finally:
            self._landed = set()

    def _update(self, used: dict[int, list[int]]) -> None:
        self._start_step()
        for layer, layer_ids in used.items():
            uses = np.bincount(np.asarray(layer_ids, dtype=np.int64), minlength=self.group.num_experts)
            self._update_scores(self._scores[layer], uses, math.ceil(len(layer_ids) / self.group.top_k))

    def _victims(self, ring: int, count: int, used: dict[int, list[int]]) -> list[Expert]:
        """The lowest-valued held experts; a just-landed expert stays only if it beats the resident it would
        replace (`_beats`), so it is valued as the weakest resident it does not beat."""
        layer = self.rings[ring].layers[0]
        held = [(layer, e) for e in range(self.group.num_experts) if (layer, e) in self._slot]
        old = sorted((x for x in held if x not in self._landed), key=lambda x: (self.score(*x), x[1]))
        new = sorted((x for x in held if x in self._landed), key=lambda x: (self.score(*x), x[1]))
        victims: list[Expert] = []
        while len(victims) < count and (old or new):
            # evict the landed one first unless it beats the weakest old resident
            take_new = bool(new) and (not old or not self._beats(self.score(*new[0]), self.score(*old[0])))
            victims.append(new.pop(0) if take_new else old.pop(0))
        return victims

    def _admit(self, decision: Decision, used: dict[int, list[int]]) -> None:
        offers = []
        for layer, layer_ids in used.items():
            offers += self._upload_offers(layer, set(layer_ids))
        # NOTE: empty slots first, then the largest gains; within a layer keys never decrease.
        offers.sort(key=lambda o: (o[0], o[1]))
        for _, _, slot, expert in offers[: self.config.promote_per_step]:
            promotion = self._place(slot, expert)
            if promotion.evicted is not None:
                decision.evictions.append((promotion.evicted, slot))
            decision.uploads.append(promotion)

    def _upload_offers(self, layer: int, used: set[int]) -> list[tuple[bool, float, int, Expert]]:
        """(is_replacement, key, slot, expert) for the layer's misses, best first."""
        scores, slots = self._scores[layer], self.rings[self.ring_of(layer)].slots
        missed = sorted((e for e in used if (layer, e) not in self._slot), key=lambda e: (-scores[e], e))
        held = [self._held[s] for s in slots]
        weakest = sorted(range(len(slots)), key=lambda i: (held[i] is not None,
                                                           scores[held[i][1]] if held[i] is not None else 0.0, i))
        offers = []
        for expert, index in zip(missed, weakest, strict=False):
            resident = held[index]
            if resident is None:
                offers.append((False, -float(scores[expert]), slots[index], (layer, expert)))
            elif self._beats(scores[expert], scores[resident[1]]):
                offers.append((True, float(scores[resident[1]] - scores[expert]), slots[index], (layer, expert)))
            else:
                break
        return offers

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Seeds each layer's scores with the profile's uses per token, then fills its slots."""
        self.check_profile(profile)
        for layer in self.group.layers:
            counts = profile.layer_counts(layer)
            num_tokens = sum(counts.values()) / self.group.top_k
            if num_tokens > 0:
                self._scores[layer] = np.zeros(self.group.num_experts)
                for expert, n in counts.items():
                    self._scores[layer][expert] = n / num_tokens * self._seed_scale()
        return super().warm_start(profile)


class DecayPolicy(ScoredPolicy):
    name = "decay"

    def _update_scores(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        scores *= self.config.decay**num_tokens
        scores += uses

    def _beats(self, candidate: float, resident: float) -> bool:
        return candidate > resident

    def _seed_scale(self) -> float:
        return 1.0 / (1.0 - self.config.decay)  # steady state of s <- decay * s + 1


class LfruPolicy(ScoredPolicy):
    name = "lfru"

    def __init__(self, group: GroupPlan, config: PolicyConfig, landing: bool = True) -> None:
        super().__init__(group, config, landing)
        self._steps = 0

    def _start_step(self) -> None:
        if self._steps and self._steps % self.config.lfru_halve_every == 0:
            for scores in self._scores.values():
                scores *= 0.5
        self._steps += 1

    def _update_scores(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        scores += uses

    def _beats(self, candidate: float, resident: float) -> bool:
        return candidate > self.config.lfru_margin * resident

    def _seed_scale(self) -> float:
        return float(self.config.lfru_halve_every)  # uses over one halving period


class StaticPolicy(CachePolicy):
    """The most used experts of a profile, filled by `warm_start`, then fixed: nothing is offered,
    evicted or uploaded, so every miss is streamed or computed by the CPU."""

    name = "static"
    needs_profile = True
    offers_slots = False

    def _make_rings(self) -> list[Ring]:
        return [Ring(range(self.group.num_slots), self.group.layers)]

    def _update(self, used: dict[int, list[int]]) -> None:
        pass

    def _victims(self, ring: int, count: int, used: dict[int, list[int]]) -> list[Expert]:
        return []

    def _admit(self, decision: Decision, used: dict[int, list[int]]) -> None:
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
