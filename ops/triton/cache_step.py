"""Triton kernels of `ops.cache_step` (the references and the semantics are there).

`assign_experts` is one program per layer: a decode step has at most 32 tokens x top-k pairs, which
one program holds in registers. With several tokens, expert ids are deduplicated through the layer's
scratch row (the first pair of each expert decides for it, found with an atomic min), so the result
does not depend on the order threads run in; one token's experts are distinct, which saves the two
round trips through memory on the batch-1 step. The same launch may prepare x for the expert kernels in its
other programs (`prepare=`), which saves the layer a launch of its own. `begin_step` is one program per layer
(publish the previous step's landings) plus programs over the host's changes, which touch disjoint entries.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops import cache_step as codes
from ops.cache_step import Bell, CpuJob, SlotTables
from ops.triton.bell import ring_bell
from ops.triton.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_rows
from ops.triton.prepare import Prepared, prepare_block
from ops.triton.qdot import GROUP
from ops.triton.tables import QType

# the outcome and change codes, as the kernels see them
PAD, HIT, STAGED, LANDED, ON_CPU = (tl.constexpr(c) for c in (codes.PAD, codes.HIT, codes.STAGED, codes.LANDED,
                                                                codes.ON_CPU))
PUBLISH, UNPUBLISH, OFFER, TAIL = (tl.constexpr(c) for c in (codes.PUBLISH, codes.UNPUBLISH, codes.OFFER, codes.TAIL))

MAX_PAIRS = 1024  # a decode step's pairs, in one program
CHANGES_BLOCK = 256


@triton.jit(do_not_specialize=["x_stride", "num_pairs", "top_k", "hidden", "row", "pair_stride", "field_stride",
                            "prep_stride", "prep_sums_stride", "prep_blocks"])
def _assign_kernel(
    ids_ptr, weights_ptr, x_ptr, x_stride, num_pairs, top_k, hidden, row,
    state, cur, host, staging, fill, scratch, pool_base, pool_stride, region_of, ring, head_of, tail_of, share_of,
    lead_of,
    num_experts, ring_capacity, record, pair_stride, field_stride,
    job_x, job_ids, job_weights, job_on_cpu, job_tokens, bell_words, bell_state,
    prep_x, prep_stride, prep_sums, prep_sums_stride, prep_blocks,
    LANDING: tl.constexpr, JOB: tl.constexpr, BELL: tl.constexpr, DEDUP: tl.constexpr, W: tl.constexpr,
    BLOCK_H: tl.constexpr, PREPARE: tl.constexpr, PREP_FMT: tl.constexpr, PREP_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    # program 0 assigns; with PREPARE, programs 1.. prepare x for the expert kernels (one launch fewer a layer)
    pid = tl.program_id(0)
    if pid == 0:
        p = tl.arange(0, W)
        in_pairs = p < num_pairs
        e = tl.load(ids_ptr + p, mask=in_pairs, other=-1).to(tl.int64)
        valid = in_pairs & (e >= 0) & (e < num_experts)
        safe = tl.where(valid, e, 0)
        row64 = row + tl.zeros([], tl.int64)
        experts_row = row64 * num_experts
        is_first = valid  # one token: its experts are distinct
        if DEDUP:  # the first pair of each expert decides for it
            tl.store(scratch + experts_row + safe, num_pairs, mask=valid)
            tl.debug_barrier()
            tl.atomic_min(scratch + experts_row + safe, p, mask=valid)
            tl.debug_barrier()
            is_first = valid & (tl.load(scratch + experts_row + safe, mask=valid, other=-1) == p)
        slot_now = tl.load(state + experts_row + safe, mask=valid, other=-1)
        # NOTE: every load before the first store, so that they are in flight together (a load after a store
        # may not pass it): the three projections' pool bases and strides and staging addresses
        parts = tl.arange(0, 4)  # gate, up, down (and one unused)
        in_parts = parts < 3
        base = tl.load(pool_base + row64 * 3 + parts, mask=in_parts, other=0)
        stride = tl.load(pool_stride + row64 * 3 + parts, mask=in_parts, other=0)
        entry = (row64 * 3 + parts[:, None]) * num_experts + safe[None, :]  # [4, W]
        staged_at = tl.load(staging + entry, mask=in_parts[:, None] & valid[None, :], other=0)
        missed = is_first & (slot_now < 0)
        rank = tl.cumsum(missed.to(tl.int32), axis=0) - 1
        num_missed = tl.sum(missed.to(tl.int32), axis=0)
        share, lead = tl.load(share_of + row), tl.load(lead_of + row)
        num_streamed = tl.minimum(tl.floor(share * num_missed.to(tl.float32) + lead + 0.5).to(tl.int32), num_missed)
        streamed = missed & (rank < num_streamed)
        on_cpu = missed & (rank >= num_streamed)
        lands = streamed & (rank < 0)  # none
        slot = tl.full([W], -1, tl.int32)
        if LANDING:
            region = tl.load(region_of + row).to(tl.int64)
            head = tl.load(head_of + region)
            available = tl.maximum(tl.load(tail_of + region) - head, 0)
            lands = streamed & (rank.to(tl.int64) < available)
            position = (head + rank.to(tl.int64)) % ring_capacity
            slot = tl.load(ring + region * ring_capacity + position, mask=lands, other=-1)
            tl.store(head_of + region, head + tl.minimum(num_streamed.to(tl.int64), available))
        outcome = tl.where(on_cpu, ON_CPU, tl.where(lands, LANDED, tl.where(streamed, STAGED, HIT)))
        address = tl.where(lands[None, :], base[:, None] + slot.to(tl.int64)[None, :] * stride[:, None], staged_at)
        tl.store(cur + entry, tl.where(on_cpu[None, :], 0, address), mask=in_parts[:, None] & missed[None, :])
        tl.store(fill + experts_row + safe, streamed.to(tl.int8), mask=is_first)
        decided, landed_slot = outcome, slot
        if DEDUP:  # every pair takes its expert's decision: (outcome + 1) | (slot + 1) << 3 through the scratch row
            tl.debug_barrier()
            tl.store(scratch + experts_row + safe, (outcome + 1) | ((slot + 1) << 3), mask=is_first)
            tl.debug_barrier()
            packed = tl.load(scratch + experts_row + safe, mask=valid, other=0)
            decided, landed_slot = (packed & 7) - 1, (packed >> 3) - 1
        pair_outcome = tl.where(valid, decided, PAD)
        pair_slot = tl.where(valid, tl.where(decided == HIT, slot_now, landed_slot), -1)
        at = record + p.to(tl.int64) * pair_stride
        tl.store(at, tl.where(valid, e, -1).to(tl.int32), mask=in_pairs)
        tl.store(at + field_stride, pair_outcome.to(tl.int32), mask=in_pairs)
        tl.store(at + 2 * field_stride, pair_slot.to(tl.int32), mask=in_pairs)
        if JOB:  # written only for CPU pairs: a layer that streams every miss writes nothing to host memory
            has_cpu_pairs = tl.sum((in_pairs & (pair_outcome == ON_CPU)).to(tl.int32), axis=0) > 0
            if has_cpu_pairs:
                num_tokens = num_pairs // top_k
                tl.store(job_tokens, num_tokens)
                tl.store(job_ids + p, tl.where(valid, e, -1).to(tl.int32), mask=in_pairs)
                tl.store(job_weights + p, tl.load(weights_ptr + p, mask=in_pairs, other=0.0).to(tl.float32),
                         mask=in_pairs)
                tl.store(job_on_cpu + p, (pair_outcome == ON_CPU).to(tl.int32), mask=in_pairs)
                cols = tl.arange(0, BLOCK_H)
                for t in range(0, num_tokens):
                    for start in range(0, hidden, BLOCK_H):
                        c = start + cols
                        v = tl.load(x_ptr + t * x_stride + c, mask=c < hidden, other=0.0).to(tl.float32)
                        tl.store(job_x + t * hidden + c, v, mask=c < hidden)
            if BELL:
                ring_bell(bell_words, bell_state, row, has_cpu_pairs)
    elif PREPARE:
        block = pid - 1
        prepare_block(x_ptr, x_stride, prep_x, prep_stride, prep_sums, prep_sums_stride, hidden,
                      block // prep_blocks, block % prep_blocks, PREP_FMT, PREP_BLOCK, GROUP)


def assign_experts(row: int, expert_ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, tables: SlotTables,
                   record: torch.Tensor, landing: bool, job: CpuJob | None = None,
                   prepare: QType | None = None) -> Prepared | None:
    """`ops.cache_step.assign_experts`; with `prepare`, the same launch also prepares x for the expert kernels of
    that format (`ops.triton.prepare`) and returns it."""
    device = tables.state.device
    tokens, top_k = expert_ids.shape
    num_pairs = tokens * top_k
    if not 0 < num_pairs <= MAX_PAIRS:
        raise ValueError(f"assign_experts: {num_pairs} pairs (1..{MAX_PAIRS})")
    check_rows("expert_ids", expert_ids, (tokens, top_k), INDEX_DTYPES, device)
    check_rows("weights", weights, (tokens, top_k), FLOAT_DTYPES, device)
    check_rows("x", x, (tokens, x.shape[1]), FLOAT_DTYPES, device)
    check_device("record", record, device)
    if record.dtype != torch.int32 or record.dim() != 2 or record.shape[1] != 3 or record.shape[0] < num_pairs:
        raise ValueError(f"record: expected int32 [>= {num_pairs}, 3], got {record.dtype} {tuple(record.shape)}")
    if expert_ids.stride(0) != top_k or weights.stride(0) != top_k:
        raise ValueError("expert_ids and weights must be contiguous [tokens, top_k]")
    if job is not None and (job.x.shape[1] != x.shape[1] or job.expert_ids.shape[0] < num_pairs):
        raise ValueError(f"job of {job.expert_ids.shape[0]} pairs x {job.x.shape[1]} for {num_pairs} x {x.shape[1]}")
    j = job if job is not None else CpuJob(*(record,) * 6)  # unused pointers when there is no job
    bell = j.bell if j.bell is not None else Bell(record, record)
    prep = Prepared.empty(x, prepare) if prepare is not None else None
    p = prep or Prepared(record, record, None)  # unused when nothing is prepared
    _assign_kernel[(1 + (tokens * p.blocks if prep is not None else 0),)](
        expert_ids, weights, x, x.stride(0), num_pairs, top_k, x.shape[1], row,
        tables.state, tables.cur, tables.host, tables.staging, tables.fill, tables.scratch, tables.pool_base,
        tables.pool_stride, tables.region, tables.ring, tables.head, tables.tail, tables.share,
        tables.lead, tables.num_experts, tables.ring.shape[1], record, record.stride(0), record.stride(1),
        j.x, j.expert_ids, j.weights, j.on_cpu, j.num_tokens, bell.words, bell.state,
        p.x, p.x.stride(0), p.sums, p.sums.stride(0), p.blocks,
        LANDING=bool(landing), JOB=job is not None, BELL=j.bell is not None, DEDUP=tokens > 1,
        W=triton.next_power_of_2(num_pairs), BLOCK_H=1024, PREPARE=prep is not None, PREP_FMT=p.fmt,
        PREP_BLOCK=p.block if prep is not None else GROUP, GROUP=GROUP, num_warps=4,
    )
    return prep


@triton.jit(do_not_specialize=["num_layers", "pair_stride", "field_stride"])
def _begin_step_kernel(
    state, cur, pool_base, pool_stride, ring, tail_of, num_experts, ring_capacity,
    record, pair_stride, field_stride, num_layers, header, changes,
    W: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_layers:  # publish the previous step's landings of layer pid
        num_pairs = tl.load(header + 1)
        for start in range(0, num_pairs, W):
            p = start + tl.arange(0, W)
            mine = p < num_pairs
            at = record + pid.to(tl.int64) + p.to(tl.int64) * pair_stride
            e = tl.load(at, mask=mine, other=-1).to(tl.int64)
            landed = mine & (tl.load(at + field_stride, mask=mine, other=PAD) == LANDED)
            slot = tl.load(at + 2 * field_stride, mask=landed, other=-1)
            tl.store(state + pid.to(tl.int64) * num_experts + tl.where(landed, e, 0), slot, mask=landed)
    else:  # the host's changes, BLOCK of them a program
        count = tl.load(header)
        i = (pid - num_layers) * BLOCK + tl.arange(0, BLOCK)
        mine = i < count
        at = changes + i.to(tl.int64) * 4
        kind = tl.load(at, mask=mine, other=-1)
        a = tl.load(at + 1, mask=mine, other=0)
        b = tl.load(at + 2, mask=mine, other=0)
        c = tl.load(at + 3, mask=mine, other=0)
        entry = a * num_experts + b
        is_publish = kind == PUBLISH
        tl.store(state + entry, c.to(tl.int32), mask=is_publish)
        tl.store(state + entry, tl.full([BLOCK], -1, tl.int32), mask=kind == UNPUBLISH)
        for part in tl.static_range(3):
            base = tl.load(pool_base + a * 3 + part, mask=is_publish, other=0)
            stride = tl.load(pool_stride + a * 3 + part, mask=is_publish, other=0)
            tl.store(cur + (a * 3 + part) * num_experts + b, base + c * stride, mask=is_publish)
        tl.store(ring + a * ring_capacity + b % ring_capacity, c.to(tl.int32), mask=kind == OFFER)
        tl.store(tail_of + a, b, mask=kind == TAIL)


def begin_step(tables: SlotTables, record: torch.Tensor, header: torch.Tensor, changes: torch.Tensor) -> None:
    num_layers = record.shape[2]
    if record.dtype != torch.int32 or record.dim() != 3 or record.shape[1] != 3 or record.stride(2) != 1:
        raise ValueError(f"record: expected int32 [pairs, 3, layers], got {record.dtype} {tuple(record.shape)}")
    if changes.dtype != torch.int64 or changes.dim() != 2 or changes.shape[1] != 4 or not changes.is_contiguous():
        raise ValueError(f"changes: expected contiguous int64 [n, 4], got {changes.dtype} {tuple(changes.shape)}")
    grid = (num_layers + triton.cdiv(changes.shape[0], CHANGES_BLOCK),)
    _begin_step_kernel[grid](
        tables.state, tables.cur, tables.pool_base, tables.pool_stride, tables.ring, tables.tail, tables.num_experts,
        tables.ring.shape[1], record, record.stride(0), record.stride(1), num_layers, header, changes,
        W=256, BLOCK=CHANGES_BLOCK, num_warps=4,
    )


@triton.jit(do_not_specialize=["num_pairs", "row", "pair_stride", "field_stride"])
def _record_prompt_kernel(ids, state, num_experts, row, record, pair_stride, field_stride, num_pairs,
                          BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mine = p < num_pairs
    e = tl.load(ids + p, mask=mine, other=-1).to(tl.int64)
    valid = mine & (e >= 0) & (e < num_experts)
    slot = tl.load(state + row.to(tl.int64) * num_experts + tl.where(valid, e, 0), mask=valid, other=-1)
    hit = valid & (slot >= 0)
    at = record + p.to(tl.int64) * pair_stride
    tl.store(at, tl.where(valid, e, -1).to(tl.int32), mask=mine)
    tl.store(at + field_stride, tl.where(valid, tl.where(hit, HIT, STAGED), PAD).to(tl.int32), mask=mine)
    tl.store(at + 2 * field_stride, tl.where(hit, slot, -1).to(tl.int32), mask=mine)


def record_prompt(row: int, expert_ids: torch.Tensor, tables: SlotTables, record: torch.Tensor) -> None:
    ids = expert_ids.reshape(-1)
    if record.dtype != torch.int32 or record.dim() != 2 or record.shape[1] != 3 or record.shape[0] < ids.numel():
        raise ValueError(f"record: expected int32 [>= {ids.numel()}, 3], got {record.dtype} {tuple(record.shape)}")
    if ids.numel():
        block = 1024
        _record_prompt_kernel[(triton.cdiv(ids.numel(), block),)](
            ids, tables.state, tables.num_experts, row, record, record.stride(0), record.stride(1), ids.numel(),
            BLOCK=block, num_warps=4)
