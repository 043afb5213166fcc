"""Replay a routing trace through the real policy code to predict hit rates (`moecache plan --trace`).

`DeviceModel` is the device side of the cache protocol in plain Python, as the engine runs it: a pick
is a hit when its expert was published at the start of the step; a missed expert lands in the next
offered slot of its layer's ring (where misses are streamed) and is published from the next step on;
the policy's decisions of step t (evictions, offers, uploads) apply from step t + 2 on, since the host
makes them while step t + 1 runs. One trace token is one decode step. Only the plan's layers (routed
experts in host RAM) count; a group without slots misses every pick.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engine.expert_cache.plan import CachePlan
from engine.expert_cache.policy import CachePolicy, Decision, Expert, PolicyConfig, make_policy
from engine.expert_cache.profile import Profile
from engine.trace import RoutingTrace

LAG = 1  # steps between the step a decision is made from and the step before which it applies


class DeviceModel:
    def __init__(self, policy: CachePolicy, lag: int = LAG, uploads: Sequence = ()) -> None:
        self.policy, self.lag = policy, lag
        self.published: dict[Expert, int] = {(p.layer, p.expert): p.slot for p in uploads}
        self.content: dict[int, Expert] = {slot: expert for expert, slot in self.published.items()}  # slot bytes
        self.rings: list[deque[int]] = [deque() for _ in policy.rings]
        self.pending: deque[Decision] = deque()
        self.held: list[tuple[int, int]] = []  # offers waiting for an upload into their slot
        self.landings = self.uploads = 0
        self.apply(policy.start())

    def apply(self, decision: Decision) -> None:
        for expert, slot in decision.evictions:
            if self.published.get(expert) == slot:
                del self.published[expert]
        self.held += decision.offers
        for p in decision.uploads:  # copies complete between steps; published unless the expert landed since
            self.content[p.slot] = (p.layer, p.expert)
            if self.policy.slot_of(p.layer, p.expert) == p.slot:
                self.published[(p.layer, p.expert)] = p.slot
        self.uploads += len(decision.uploads)
        # NOTE: as the engine: a slot an upload not yet applied will write is offered once that upload is done
        copying = {p.slot for d in self.pending for p in d.uploads}
        for ring, slot in self.held:
            if slot not in copying:
                self.rings[ring].append(slot)
        self.held = [(ring, slot) for ring, slot in self.held if slot in copying]

    def prepare(self, used: Mapping[int, Sequence[int]]) -> Decision:
        """As the engine before a step: a step of more tokens than the last gets offers for its misses at
        once (`CachePolicy.reserve`). `step` calls it; called first, `step` adds nothing."""
        num_tokens = max((-(-len(ids) // self.policy.group.top_k) for ids in used.values()), default=1)
        decision = self.policy.reserve(num_tokens)
        self.apply(decision)
        return decision

    def step(self, used: Mapping[int, Sequence[int]], on_cpu: frozenset[Expert] = frozenset(),
             upload_cpu: bool = True) -> tuple[int, dict[Expert, int], Decision]:
        """One step: (hits, landings, the policy's decision), the decision applied `lag` steps later.
        `on_cpu`: experts whose misses the CPU computes (hybrid): they do not land; with `upload_cpu` the
        policy promotes them by uploads (`Split.uploads_cpu_misses`)."""
        self.prepare(used)
        hits, landed, computed = 0, {}, set()
        for layer, ids in used.items():
            for e in ids:
                hits += (layer, e) in self.published
            ring = self.rings[self.policy.ring_of(layer)]
            for e in dict.fromkeys(ids):  # each missed expert once, in pair order
                if (layer, e) in self.published or (layer, e) in landed:
                    continue
                if (layer, e) in on_cpu:
                    computed.add((self.policy.row[layer], e))
                elif self.policy.landing and ring:
                    landed[(layer, e)] = ring.popleft()
        self.published.update(landed)
        self.content.update({slot: expert for expert, slot in landed.items()})
        self.landings += len(landed)
        computed_rows = np.array(sorted(computed) if upload_cpu else [], dtype=np.int64).reshape(-1, 2)
        decision = self.policy.observe(used, landed, computed_rows)
        self.pending.append(decision)
        while len(self.pending) > self.lag:
            self.apply(self.pending.popleft())
        return hits, landed, decision


@dataclass(frozen=True)
class ReplayResult:
    hit_ratio: float  # over every pick of the plan's layers
    per_group: dict[int, float]  # group_id -> hit ratio
    promotions: int  # landings and uploads during the trace (a warm-start fill not counted)


def profile_from_trace(trace: RoutingTrace) -> Profile:
    """Use counts of every trace layer, e.g. to warm-start a replay of another trace."""
    profile = Profile()
    for axis, layer in enumerate(trace.layers):
        profile.add(layer, trace.expert_ids[:, axis].ravel().tolist())
    return profile


def _group_axes(trace: RoutingTrace, plan: CachePlan) -> dict[int, list[tuple[int, int]]]:
    """group_id -> [(trace axis, model layer)] for the plan's layers present in the trace."""
    axes: dict[int, list[tuple[int, int]]] = {}
    for axis, layer in enumerate(trace.layers):
        group = plan.group_of(layer)
        if group is None:
            continue
        if (group.num_experts, group.top_k) != (trace.num_experts, trace.top_k):
            raise ValueError(
                f"layer {layer}: trace has {trace.num_experts} experts, top-{trace.top_k}; "
                f"the plan has {group.num_experts}, top-{group.top_k}"
            )
        axes.setdefault(group.group_id, []).append((axis, layer))
    return axes


def replay(trace: RoutingTrace, plan: CachePlan, policy: str, config: PolicyConfig, profile: Profile | None = None,
           landing: bool = True, lag: int = LAG) -> ReplayResult:
    """`landing`: misses are streamed and land (stream, hybrid); else they are uploaded (cpu). `lag`: steps
    before a decision applies (0: at once, the textbook cache)."""
    devices = {}
    for g in plan.groups:
        if g.is_cached:
            cache_policy = make_policy(policy, g, config, profile, landing)
            warm = cache_policy.warm_start(profile) if profile is not None else []
            devices[g.group_id] = DeviceModel(cache_policy, lag, uploads=warm)
    axes = _group_axes(trace, plan)
    hits: Counter[int] = Counter()
    for token in trace.expert_ids.tolist():  # [num_layers][top_k]
        for group_id, pairs in axes.items():
            if group_id in devices:
                hits[group_id] += devices[group_id].step({layer: token[a] for a, layer in pairs})[0]
    picks = {g: len(pairs) * trace.num_tokens * trace.top_k for g, pairs in axes.items()}
    per_group = {g: hits[g] / n if n else 0.0 for g, n in picks.items()}
    total = sum(picks.values())
    promotions = sum(d.landings + d.uploads for d in devices.values())
    return ReplayResult(sum(hits.values()) / total if total else 0.0, per_group, promotions)
