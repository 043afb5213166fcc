"""Pair bookkeeping shared by the expert kernels: which pairs count, and which pairs share an expert.

A pair is one (token, expert) of a step. Its expert id indexes three per-layer pointer tables; a pair
counts only if the id is in range and all three of its pointers are set (> 0). Programs are laid out
one per pair position; the pairs of one expert inside a window of WINDOW positions form its group, ranked
in position order. Spread (the default), the member of rank r with r % BT == 0 computes members r .. r + BT - 1
together, reading the expert's weights once for them: an expert that many tokens of a step chose (a hot expert,
or rows that route alike) takes as many programs side by side, not one program's passes in a row. Not spread (an
expert a program first copies from host memory), the group's first member computes all of it. Every other
program finds it leads nothing and does no work. Spread with one pair a pass and no copy (a resident batch-1 step),
the window is one pair: each pair computes itself, with no scan. Everything stays on the device: no sort, no host
sync, and a grid that depends only on the pair count.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

MAX_WINDOW = 256  # pairs scanned for the group of an expert (32 tokens x top-8)


def window_for(num_pairs: int, block_tokens: int = 0, spread: bool = False, fills: bool = True) -> int:
    """The window a launch scans for each pair's group. Spread, one pair a pass and nothing copied from host memory,
    each pair computes itself: a window of one pair, no scan (a batch-1 decode step's case)."""
    if spread and block_tokens == 1 and not fills:
        return 1
    return min(triton.next_power_of_2(max(num_pairs, 1)), MAX_WINDOW)


@triton.jit
def expert_pointers(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs):
    """Expert ids (any shape) -> (whether the pair is computed, the id safe to index with (0 where out of range),
    its gate, up and down addresses (0 where out of range)). NOTE: a kernel keeps the addresses it loaded here:
    loading them again after a branch or a barrier would put another memory round trip before its weights."""
    in_range = (expert >= 0) & (expert < num_experts)
    safe = tl.where(in_range, expert, 0)
    gate = tl.load(gate_ptrs + safe, mask=in_range, other=0)
    up = tl.load(up_ptrs + safe, mask=in_range, other=0)
    down = tl.load(down_ptrs + safe, mask=in_range, other=0)
    return in_range & (gate > 0) & (up > 0) & (down > 0), safe, gate, up, down


@triton.jit
def group_of(expert_ids, num_pairs, pid, expert, is_valid, spread, BT: tl.constexpr, WINDOW: tl.constexpr):
    """The pairs of `expert` in pid's window: (positions `[WINDOW]`, member mask, member rank, and the ranks
    first .. end - 1 that pid computes: BT from its own rank where `spread` and that rank is a multiple of BT,
    else the whole group where pid is its first member; first == end where pid computes nothing)."""
    positions = (pid // WINDOW) * WINDOW + tl.arange(0, WINDOW)
    in_pairs = positions < num_pairs
    ids = tl.load(expert_ids + positions, mask=in_pairs, other=-1)
    is_member = in_pairs & (ids == expert)
    rank = tl.cumsum(is_member.to(tl.int32), axis=0) - 1
    count = tl.sum(is_member.to(tl.int32), axis=0)
    mine = tl.sum(tl.where(positions == pid, rank, 0), axis=0)  # pid is a member of its expert's group
    first = tl.where(spread, mine, 0)
    end = tl.where(spread, tl.minimum(mine + BT, count), count)
    leads = is_valid & tl.where(spread, mine % BT == 0, mine == 0)
    return positions, is_member, rank, first, tl.where(leads, end, first)


@triton.jit
def chunk_of(positions, is_member, rank, start, BT: tl.constexpr):
    """Members start .. start + BT - 1 of a group: their pair positions `[BT]` and which slots are filled."""
    slot = start + tl.arange(0, BT)
    picks = is_member[None, :] & (rank[None, :] == slot[:, None])  # [BT, WINDOW]
    position = tl.sum(tl.where(picks, positions[None, :], 0), axis=1)
    return position, tl.sum(picks.to(tl.int32), axis=1) > 0


@triton.jit
def slot(values, index: tl.constexpr):
    """Element `index` of a `[BT]` vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == index, values, 0), axis=0)


@triton.jit
def slots(values, BT: tl.constexpr):
    """The first 4 elements of a `[BT]` vector as scalars (element 0 repeated past BT)."""
    v0 = slot(values, 0)
    v1, v2, v3 = v0, v0, v0
    if BT > 1:
        v1 = slot(values, 1)
    if BT > 2:
        v2 = slot(values, 2)
        v3 = slot(values, 3)
    return v0, v1, v2, v3
