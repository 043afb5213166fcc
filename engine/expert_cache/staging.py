"""Prefill's expert staging (CUDA): a large batch uses nearly every expert of a layer, so each host layer's
uncached experts are copied into a VRAM buffer on the copy stream while the layers before it compute, in runs of
consecutive experts from pinned host memory (one copy per run and part: the copy engine's, which leaves the
multiprocessors to the layer's kernels). Two buffers at least (double buffering); where the device has memory to
spare past the cache's headroom, up to `MAX_BUFFERS`, so that the link keeps copying layers ahead while layers whose
experts are all cached compute (those copy nothing and take no buffer).

Cached experts are read where they are (`in_place`): the staged layer's tables (`tables`) address each cached
expert in its slot and each other one in the buffer, for kernels that find experts through such tables (the fused
prefill GEMMs, `ops.triton.moe_gemm`, and the decode kernels). Where the prefill reads a whole bank instead (the
dequantizing grouped GEMM, `ops.grouped_gemm`), cached experts are copied from their slots too (device to device).
Where the runs to copy are more than `GATHER_RUNS`, one launch a part copies every expert from its address
instead (`ops.triton.gather_experts`): a copy call a run would cost the host more than the copies take.
A layer on disk (`--ssd-moe`) stages only the experts the batch uses, the uncached ones read through the host-RAM
tier a slot pool's worth at a time, each copy waited for before the tier refills its slots (no prefetch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from engine.expert_cache.device import CopyEngine, bank_shape, empty_bank, expert_parts
from engine.expert_cache.ram_tier import RamTier
from ops.bank import ExpertWeights
from ops.expert_math import ExpertMath

if TYPE_CHECKING:
    from ops.triton.tables import ExpertTables

GATHER_RUNS = 8  # runs of a layer past which its staging is one gather launch a part, not a copy call a run
# NOTE: a layer of 128 experts half cached in place has ~32 uncached runs: copies of 2-3 MB on the copy engine
IN_PLACE_GATHER_RUNS = 64
# layers staged ahead at most (a buffer each): a prompt's first half of layers all cached left the link idle for 44 of
# its 205 ms with two buffers (Qwen3-30B-A3B's shapes, pp512, a 50% cache, H100: docs/benchmarks.md)
MAX_BUFFERS = 8


class LayerStager:
    def __init__(self, host: Mapping[int, ExpertWeights], pools: Mapping[int, ExpertWeights],
                 group_of: Mapping[int, int], slots_of: Callable[[int], list[int]], copies: CopyEngine,
                 tier: RamTier | None = None, in_place: bool = False, spare_bytes: int | None = None) -> None:
        """slots_of(layer): the slot (or -1) of each of the layer's experts, as published now. tier: the layers on
        disk (their `host` banks are the map's views, never read). in_place: cached experts are read in their slots
        through `tables`, not copied. spare_bytes: the device memory a third or later buffer must leave free (None:
        two buffers only)."""
        self.host, self.pools, self.group_of, self.slots_of, self.copies = host, pools, group_of, slots_of, copies
        self.tier, self.in_place, self.spare_bytes = tier, in_place, spare_bytes
        self.gather_runs = IN_PLACE_GATHER_RUNS if in_place else GATHER_RUNS
        self.order = sorted(host)
        # bank shape -> its buffers, the one filled longest ago first
        # NOTE: a buffer is refilled only after the layer it held was handed out (`bank`): fewer layers in `ready`
        # hold buffers of a shape than it has, and they are the last ones filled
        self.buffers: dict[tuple, deque[ExpertWeights]] = {}
        self.most: dict[tuple, int] = {}  # bank shape -> the buffers the device had memory for
        self.free: dict[int, torch.cuda.Event] = {}  # id(buffer) -> recorded after its last reader
        # layer -> (buffer, copied); a layer that copies nothing: (its host bank, None)
        self.ready: dict[int, tuple[ExpertWeights, torch.cuda.Event | None]] = {}
        self._tables: dict[tuple, torch.Tensor] = {}  # (layer, buffer, slots) -> its addresses `[3, experts]`
        self._math: dict[int, ExpertMath] = {}  # layer -> its expert math on the device

    def bank(self, layer: int, used: list[int] | None = None) -> ExpertWeights:
        """The layer's experts in VRAM, ready for the compute stream; starts copying the next host layer.
        used: a layer on disk's experts the batch selects (only their rows are staged)."""
        if self.tier is not None and layer in self.tier.layouts:
            assert used is not None, "a layer on disk stages the experts the batch uses"
            self._upload_from_disk(layer, self.tier, used)
        elif layer not in self.ready:
            self._upload(layer, self.copied_runs(layer))
        self._stage_next(layer)
        buffer, copied = self.ready.pop(layer)
        if copied is not None:
            torch.cuda.current_stream(buffer.gate.device).wait_event(copied)
        return buffer

    def _stage_next(self, layer: int) -> None:
        """Start copying the host layers after `layer` that copy anything, as many as there are buffers for: one whose
        experts are all read in their slots takes no buffer, so the link stages layers across cached ones. A layer on
        disk stops it."""
        for following in self.order[self.order.index(layer) + 1:]:
            if self._on_disk(following):
                return
            if following not in self.ready:
                runs = self.copied_runs(following)
                if runs and not self._has_buffer(self.host[following]):
                    return
                self._upload(following, runs)

    def release(self, buffer: ExpertWeights) -> None:
        """The compute stream has queued its last read of `buffer`: it may be refilled after that (a layer that
        copied nothing was handed its host bank, no buffer)."""
        if not any(buffer is b for pair in self.buffers.values() for b in pair):
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buffer.gate.device))
        self.free[id(buffer)] = event

    def finish(self) -> None:
        """The step is over: the compute stream waits for any copy still in flight (a prefetched layer the
        step did not use), so no later step can land an expert in a slot being read."""
        if self.ready:
            torch.cuda.current_stream(self.copies.device).wait_stream(self.copies.stream)
        self.ready.clear()

    def tables(self, layer: int, buffer: ExpertWeights) -> ExpertTables:
        """The staged layer as the kernels read it, by expert id: each cached expert in its slot where `in_place`
        (else in `buffer`, copied there), each other one in `buffer`; the layer's expert math."""
        # NOTE: a slot named here keeps its expert while the prompt's kernels read it: a prompt never changes the
        # cache, and a later copy into a slot first waits for the compute stream (`CopyEngine.copy`)
        from ops.triton.tables import ExpertTables

        host, device = self.host[layer], self.copies.device  # `buffer` is the host bank where nothing was copied
        key = (layer, buffer.gate.data_ptr(), tuple(self.slots_of(layer)[:host.num_experts]) if self.in_place else ())
        ptrs = self._tables.get(key)
        if ptrs is None:
            runs = self.runs(layer) if self.in_place else [(0, host.num_experts, -1)]
            ptrs = torch.tensor(self.sources(layer, runs, buffer), dtype=torch.int64)
            if device.type == "cuda":
                ptrs = ptrs.pin_memory().to(device, non_blocking=True)
            self._tables = {k: v for k, v in self._tables.items() if k[0] != layer} | {key: ptrs}
        math = self._math.get(layer)
        if math is None:
            math = self._math[layer] = host.math.to(device)
        return ExpertTables(ptrs[0], ptrs[1], ptrs[2], host.gate_type, host.up_type, host.down_type, host.hidden,
                            host.ff, math)

    def _upload(self, layer: int, runs: list[tuple[int, int, int]]) -> None:
        """Stage the layer's `runs` (`copied_runs`) into a buffer, or mark it ready in place where there are none."""
        host = self.host[layer]
        if not runs:  # every expert read in its slot: its tables name no buffer
            self.ready[layer] = (host, None)
            return
        buffer = self._next_buffer(host)
        after = self.free.pop(id(buffer), None)
        if len(runs) > self.gather_runs:
            host_bytes = sum(stop - start for start, stop, slot in runs if slot < 0) * host.expert_bytes
            parts = expert_parts(buffer, slice(None))
            rows = [e for start, stop, _ in runs for e in range(start, stop)]
            sources = [[part[e] for e in rows] for part in self.sources(layer, runs, host)]
            self.ready[layer] = (buffer, self.copies.gather(sources, rows, parts, host_bytes, after))
            return
        pairs = []
        for start, stop, slot in runs:
            src = self.pools[self.group_of[layer]] if slot >= 0 else host
            first = slot if slot >= 0 else start
            for dst_part, src_part in zip(expert_parts(buffer, slice(start, stop)),
                                          expert_parts(src, slice(first, first + stop - start))):
                pairs.append((dst_part, src_part))
        self.ready[layer] = (buffer, self.copies.upload(pairs, after=after))

    def sources(self, layer: int, runs: list[tuple[int, int, int]], uncached: ExpertWeights) -> list[list[int]]:
        """For gate, up and down: the address of each of the layer's experts in `runs`, in its slot or, uncached, in
        the bank `uncached` (host memory, or the staging buffer) at its own row; 0 for the experts of no run."""
        sources = [[0] * len(self.host[layer].gate) for _ in range(3)]
        for start, stop, slot in runs:
            src, first = (self.pools[self.group_of[layer]], slot) if slot >= 0 else (uncached, start)
            for i, t in enumerate(expert_parts(src, slice(None))):
                base, step = t.data_ptr(), t.stride(0)
                sources[i][start:stop] = range(base + first * step, base + (first + stop - start) * step, step)
        return sources

    def _on_disk(self, layer: int) -> bool:
        return self.tier is not None and layer in self.tier.layouts

    def _upload_from_disk(self, layer: int, tier: RamTier, used: list[int]) -> None:
        """The used experts' rows: cached ones from their slots, the rest read into the tier and copied from there.
        NOTE: a RAM slot holds its expert until the next `load`: each chunk's copy is waited for before the next."""
        buffer, slots = self._next_buffer(self.host[layer]), self.slots_of(layer)
        pool = self.pools.get(self.group_of.get(layer, -1))
        pairs = [pair for e in used if slots[e] >= 0 and pool is not None
                 for pair in zip(expert_parts(buffer, e), expert_parts(pool, slots[e]))]
        missed = [e for e in used if slots[e] < 0 or pool is None]
        after = self.free.pop(id(buffer), None)
        for start in range(0, len(missed), tier.num_slots):
            chunk = missed[start:start + tier.num_slots]
            ram = tier.load(layer, chunk)
            pairs += [pair for e, s in zip(chunk, ram)
                      for pair in zip(expert_parts(buffer, e), expert_parts(tier.banks[layer], s))]
            self.copies.upload(pairs, after).synchronize()
            pairs, after = [], None
        self.ready[layer] = (buffer, self.copies.upload(pairs, after))

    def copied_runs(self, layer: int) -> list[tuple[int, int, int]]:
        """The runs a layer's staging copies: the uncached ones where cached experts are read `in_place`, else all."""
        return [run for run in self.runs(layer) if run[2] < 0 or not self.in_place]

    def runs(self, layer: int) -> list[tuple[int, int, int]]:
        """(start, stop, slot): runs of consecutive uncached experts (slot -1), single cached ones."""
        slots = self.slots_of(layer)[:self.host[layer].gate.shape[0]]
        runs: list[tuple[int, int, int]] = []
        for expert, slot in enumerate(slots):
            if slot < 0 and runs and runs[-1][2] < 0 and runs[-1][1] == expert:
                runs[-1] = (runs[-1][0], expert + 1, -1)
            else:
                runs.append((expert, expert + 1, slot))
        return runs

    def _has_buffer(self, like: ExpertWeights) -> bool:
        """Whether a layer like `like` can be staged now: a buffer of its shape holds no staged layer, or one more
        may be made."""
        pool = self.buffers.get(_key(like), deque())
        return self._held(pool) < len(pool) or self._may_grow(like, pool)

    def _held(self, pool: deque[ExpertWeights]) -> int:
        """Buffers of `pool` that hold a staged layer not yet handed out."""
        return sum(1 for buffer, copied in self.ready.values() if copied is not None and any(buffer is b for b in pool))

    def _may_grow(self, like: ExpertWeights, pool: deque[ExpertWeights]) -> bool:
        """Two buffers always; more while the device keeps spare_bytes free (asked until it first says no)."""
        if len(pool) < 2:
            return True
        if self.spare_bytes is None or len(pool) >= self.most.get(_key(like), MAX_BUFFERS) or \
                self.copies.device.type != "cuda":
            return False
        size = sum(t.nbytes for t in expert_parts(like, slice(None)))
        if torch.cuda.mem_get_info(self.copies.device)[0] - size >= self.spare_bytes:
            return True
        self.most[_key(like)] = len(pool)
        return False

    def _next_buffer(self, like: ExpertWeights) -> ExpertWeights:
        """A buffer for the next staged layer: a new one where every buffer holds a staged layer, else the one filled
        longest ago."""
        pool = self.buffers.setdefault(_key(like), deque())
        if self._held(pool) == len(pool):
            assert self._may_grow(like, pool), "a layer is staged only where a buffer is free or can be made"
            pool.append(empty_bank(like, like.gate.shape[0], self.copies.device))
        else:
            pool.rotate(-1)
        return pool[-1]


def _key(bank: ExpertWeights) -> tuple:
    return bank_shape(bank), bank.gate.shape[0]
