"""The expert cache's device-side steps, with their torch references: what a decode step does to the
cache's tables, all on the device (no host sync, so the step stays one CUDA graph).

- `assign_experts` (one call per MoE layer, after the router): looks up every selected expert's slot,
  and for each missed expert (once per step, however many tokens chose it) decides where it is computed:
  streamed by the device (its fill flag set, so the expert kernels copy it from host memory before
  using it) into a free slot taken from the layer's ring of offered slots (it *lands*: the copy is the
  cache's promotion, the bytes cross PCIe once) or, when the ring is empty, into its staging row; or
  computed by the CPU (its pointers 0, so the device skips it; the layer's CPU job gets its pairs).
  The hybrid split is by rank: the first `share x misses + lead` missed experts (in pair order) are
  streamed, so the CPU takes a layer's misses only when they outweigh its fixed cost (`lead`).
  It writes the layer's row of the step record: expert id, outcome and slot of every pair.
- `begin_step` (once per step, before the first layer): publishes the previous step's landings
  (state := slot) and applies the host's changes (publish, unpublish, offer slots, ring tail), which
  the host decided off the critical path while the previous step ran.
- `record_prompt` (a prompt's layer): the layer's row of the step record only (each pair a hit in its slot or
  staged); a prompt reads the cache and never changes it.

NOTE: tables change only at `begin_step` and, for the experts a step selects, in that layer's
`assign_experts`; a layer's row is read by the kernels of that layer only, so no kernel reads a
half-copied expert: a fill completes inside the expert kernels before they read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# outcome of a pair in the step record
PAD, HIT, STAGED, LANDED, ON_CPU = -1, 0, 1, 2, 3
# host changes applied by `begin_step`, (kind, a, b, c) rows of int64: PUBLISH (row, expert, slot),
# UNPUBLISH (row, expert, -), OFFER (ring, position, slot), TAIL (ring, tail, -)
PUBLISH, UNPUBLISH, OFFER, TAIL = 0, 1, 2, 3
PARTS = 3  # gate, up, down


@dataclass(frozen=True)
class SlotTables:
    """The cache's device state, one row per MoE layer (rows of resident layers unused)."""

    state: torch.Tensor  # int32 [layers, experts]: slot of each published expert, else -1
    cur: torch.Tensor  # int64 [layers, 3, experts]: address the expert kernels read (gate, up, down)
    host: torch.Tensor  # int64 [layers, 3, experts]: address of each expert in host memory
    staging: torch.Tensor  # int64 [layers, 3, experts]: the staging row of each expert (a miss that does not land)
    fill: torch.Tensor  # int8 [layers, experts]: 1 when this step's kernels copy the expert host -> cur
    scratch: torch.Tensor  # int32 [layers, experts]: per-expert scratch of `assign_experts`
    pool_base: torch.Tensor  # int64 [layers, 3]: address of slot 0 of the layer's slot pool
    pool_stride: torch.Tensor  # int64 [layers, 3]: bytes from one slot to the next
    region: torch.Tensor  # int32 [layers]: the ring the layer's misses land from
    ring: torch.Tensor  # int32 [rings, capacity]: offered slots
    head: torch.Tensor  # int64 [rings]: next position the device takes (the device's)
    tail: torch.Tensor  # int64 [rings]: one past the last offered position (the host's)
    share: torch.Tensor  # float32 [layers]: share of a layer's missed experts the device streams (rest: CPU)
    lead: torch.Tensor  # float32 [layers]: missed experts streamed before the share applies (the CPU's fixed cost)

    @property
    def num_experts(self) -> int:
        return int(self.state.shape[1])


TASK_BITS = 16  # a ring word is seq << TASK_BITS | task


@dataclass(frozen=True)
class Bell:
    """The doorbell of a step's CPU jobs (`ops/csrc/bell.h`). `words`: int64 `[16]` of pinned host memory,
    `[0]` the ring (seq << TASK_BITS | task: written by the device once the layer's job is written, when it
    has CPU pairs) and `[8]` done (seq: written by the CPU's watcher once the job's output is); `state`: int64
    `[2]` on the device, the last sequence number rung and whether the current layer rang (1 or 0), which
    the kernel that adds the CPU's output reads (it waits for done >= seq first)."""

    words: torch.Tensor
    state: torch.Tensor

    RING, DONE = 0, 8  # word indexes (a cache line apart)

    @classmethod
    def allocate(cls, device: torch.device) -> Bell:
        pin = device.type == "cuda"
        return cls(torch.zeros(16, dtype=torch.int64, pin_memory=pin), torch.zeros(2, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class CpuJob:
    """What the CPU computes for one layer: pinned host memory the device writes and the CPU reads
    (inputs) and the CPU writes and the device reads (out). Shared by the layers of a step: layer
    l + 1 starts only after layer l has added the CPU's output."""

    x: torch.Tensor  # float32 [max_tokens, hidden]
    expert_ids: torch.Tensor  # int32 [max_tokens * top_k]
    weights: torch.Tensor  # float32 [max_tokens * top_k]
    on_cpu: torch.Tensor  # int32 [max_tokens * top_k]: nonzero where the CPU computes the pair
    num_tokens: torch.Tensor  # int32 [1]
    out: torch.Tensor  # float32 [max_tokens, hidden]
    bell: Bell | None = None  # rung by `assign_experts` when the layer has CPU pairs (None: the host runs the job)

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, hidden: int, pin: bool, bell: Bell | None = None) -> CpuJob:
        def new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        pairs = max_tokens * top_k
        return cls(new((max_tokens, hidden), torch.float32), new((pairs,), torch.int32),
                   new((pairs,), torch.float32), new((pairs,), torch.int32), new((1,), torch.int32),
                   new((max_tokens, hidden), torch.float32), bell)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def assign_experts(row: int, expert_ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, tables: SlotTables,
                   record: torch.Tensor, landing: bool, job: CpuJob | None = None) -> None:
    """expert_ids, weights `[tokens, top_k]` (id -1: no expert) and x `[tokens, hidden]` of MoE layer `row`;
    record: int32 `[>= pairs, 3]` (ids, outcome, slot of each pair; any strides), this layer's part of the
    step record. `landing`: misses may take offered slots. `job`: the layer's CPU job, written only when the layer
    has CPU pairs (the host reads a job only when its layer rang): a layer that streams every miss writes nothing
    to host memory."""
    if _use_triton(expert_ids):
        from ops.triton.cache_step import assign_experts as fused
        fused(row, expert_ids, weights, x, tables, record, landing, job)
    else:
        assign_experts_torch(row, expert_ids, weights, x, tables, record, landing, job)


def begin_step(tables: SlotTables, record: torch.Tensor, header: torch.Tensor, changes: torch.Tensor) -> None:
    """record: int32 `[max_pairs, 3, layers]` of the previous step; header: int64 `[>= 2]` (number of
    changes, pairs of the previous step); changes: int64 `[max_changes, 4]`. Both may be pinned host
    memory (read in place by the device). NOTE: no change names an expert that landed in the previous
    step (the host decides from older records), so the two apply in any order."""
    if _use_triton(tables.state):
        from ops.triton.cache_step import begin_step as fused
        fused(tables, record, header, changes)
    else:
        begin_step_torch(tables, record, header, changes)


def record_prompt(row: int, expert_ids: torch.Tensor, tables: SlotTables, record: torch.Tensor) -> None:
    """A prompt's layer `row` (the cache is read, never changed): each pair's expert id (-1: none), outcome (a hit in
    its published slot, else staged; PAD without an expert) and slot into record, int32 `[>= pairs, 3]` (any
    strides). One launch on the device: a prompt's step is launched layer by layer from the host."""
    if _use_triton(expert_ids):
        from ops.triton.cache_step import record_prompt as fused
        fused(row, expert_ids, tables, record)
    else:
        record_prompt_torch(row, expert_ids, tables, record)


# --- torch references -------------------------------------------------------------------------------------


def record_prompt_torch(row: int, expert_ids: torch.Tensor, tables: SlotTables, record: torch.Tensor) -> None:
    ids = expert_ids.flatten()
    valid = (ids >= 0) & (ids < tables.num_experts)
    slots = tables.state[row][torch.where(valid, ids, 0)].long()
    outcome = torch.where(valid, torch.where(slots >= 0, HIT, STAGED), PAD)
    n = ids.numel()
    record[:n, 0], record[:n, 1] = torch.where(valid, ids, -1).to(record), outcome.to(record)
    record[:n, 2] = torch.where(outcome == HIT, slots, -1).to(record)


def _streamed_count(share: torch.Tensor, lead: torch.Tensor, num_missed: int) -> int:
    """round(share x misses + lead), at most the misses, in float32 as the kernel computes it."""
    value = (share.float() * torch.tensor(float(num_missed), dtype=torch.float32) + lead.float() + 0.5).floor()
    return min(int(value), num_missed)


def assign_experts_torch(row: int, expert_ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                         tables: SlotTables, record: torch.Tensor, landing: bool, job: CpuJob | None = None) -> None:
    ids = expert_ids.flatten().long().cpu()
    num_pairs, num_experts = ids.numel(), tables.num_experts
    valid = (ids >= 0) & (ids < num_experts)
    state = tables.state[row].cpu()
    first: dict[int, int] = {}  # expert -> its first pair: the pair that decides for the expert
    for p, e in enumerate(ids.tolist()):
        if 0 <= e < num_experts:
            first.setdefault(e, p)
    missed = [e for e, _ in sorted(first.items(), key=lambda kv: kv[1]) if int(state[e]) < 0]  # pair order
    streamed = _streamed_count(tables.share[row].cpu(), tables.lead[row].cpu(), len(missed))
    region = int(tables.region[row])
    head, tail = int(tables.head[region]), int(tables.tail[region])
    available = max(tail - head, 0) if landing else 0
    capacity = tables.ring.shape[1]
    code: dict[int, tuple[int, int]] = {}  # expert -> (outcome, slot)
    for rank, e in enumerate(missed):
        if rank < min(streamed, available):
            slot = int(tables.ring[region, (head + rank) % capacity])
            code[e] = (LANDED, slot)
            address = tables.pool_base[row] + slot * tables.pool_stride[row]
        elif rank < streamed:
            code[e], address = (STAGED, -1), tables.staging[row, :, e]
        else:
            code[e], address = (ON_CPU, -1), torch.zeros(3, dtype=torch.int64)
        tables.cur[row, :, e] = address.to(tables.cur.device)
    if landing:
        tables.head[region] = head + min(streamed, available)
    for e in first:
        tables.fill[row, e] = int(code.get(e, (HIT,))[0] in (STAGED, LANDED))
    outcome = torch.full((num_pairs,), PAD, dtype=torch.int32)
    slots = torch.full((num_pairs,), -1, dtype=torch.int32)
    for p, e in enumerate(ids.tolist()):
        if valid[p]:
            outcome[p], slots[p] = code.get(e, (HIT, int(state[e])))
    record[:num_pairs, 0] = torch.where(valid, ids, -1).to(record)
    record[:num_pairs, 1], record[:num_pairs, 2] = outcome.to(record), slots.to(record)
    if job is not None:
        has_cpu_pairs = bool((outcome == ON_CPU).any())
        if has_cpu_pairs:
            _write_job(job, ids, valid, outcome, weights, x)
        if job.bell is not None:
            ring_bell_torch(job.bell, row, has_cpu_pairs)


def ring_bell_torch(bell: Bell, task: int, rang: bool) -> None:
    """The device's ring, after the job is written: the next sequence number when the layer has CPU pairs."""
    bell.state[1] = int(rang)
    if rang:
        seq = int(bell.state[0]) + 1
        bell.state[0] = seq
        bell.words[Bell.RING] = seq << TASK_BITS | task


def _write_job(job: CpuJob, ids: torch.Tensor, valid: torch.Tensor, outcome: torch.Tensor, weights: torch.Tensor,
               x: torch.Tensor) -> None:
    num_pairs, num_tokens = ids.numel(), x.shape[0]
    job.num_tokens[0] = num_tokens
    job.expert_ids[:num_pairs] = torch.where(valid, ids, -1).to(torch.int32)
    job.weights[:num_pairs] = weights.flatten().float().cpu()
    job.on_cpu[:num_pairs] = (outcome == ON_CPU).to(torch.int32)
    job.x[:num_tokens] = x.float().cpu()


def begin_step_torch(tables: SlotTables, record: torch.Tensor, header: torch.Tensor, changes: torch.Tensor) -> None:
    num_changes, num_pairs = int(header[0]), int(header[1])
    ids, outcome, slots = (record[:num_pairs, i, :].T.long() for i in range(3))  # [layers, pairs]
    rows, pairs = (outcome == LANDED).nonzero(as_tuple=True)
    tables.state[rows, ids[rows, pairs]] = slots[rows, pairs].to(tables.state)
    capacity = tables.ring.shape[1]
    for kind, a, b, c in changes[:num_changes].tolist():
        if kind == PUBLISH:
            tables.state[a, b] = c
            tables.cur[a, :, b] = tables.pool_base[a] + c * tables.pool_stride[a]
        elif kind == UNPUBLISH:
            tables.state[a, b] = -1
        elif kind == OFFER:
            tables.ring[a, b % capacity] = c
        elif kind == TAIL:
            tables.tail[a] = b
        else:
            raise ValueError(f"unknown cache table change {kind}")
