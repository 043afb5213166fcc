"""The host-RAM tier in front of the GGUF file (`--ssd-moe`, `--n-ssd-moe`): routed experts of the disk layers
stay in the file; a fixed pool of expert-sized slots in host memory (pinned where a device reads it, allocated
once at `--host-cache-mib`) holds the recently used ones, LRU. A miss is read with `os.preadv` at the expert's
byte offsets in the file (gate, up and down: three ranges, or two where merged gate/up rows are adjacent),
several reads in flight on a small thread pool. Whole experts, never whole layers, and never through the map:
the map's pages of a disk layer are never touched, so the process holds at most the pool of them.

In llama.cpp's spirit (`--ssd-streaming`): only the experts a step selects are read.

The tier is exclusive of the device cache: an expert the cache evicts is copied back into the tier (`keep`), one
that lands in the cache is the tier's first to go (`let_go`), so that the two hold different experts.

`SlotLru` is the torch-free bookkeeping; `DiskReader` the reads; `RamTier` the pool, its banks and the
expert FFN over them (`ffn`), the one seam the dispatcher and the CPU tasks call.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.expert_cache.device import copy_pairs
from engine.expert_cache.stats import CacheStats
from ops.bank import ExpertWeights
from ops.expert_ffn import expert_ffn

MiB = 1 << 20
READ_THREADS = 4  # reads in flight: enough to keep an NVMe queue busy, few enough to leave the cores to compute


class SlotLru:
    """Which key (an expert `(layer, expert)`) holds which of `num_slots` slots, least recently used evicted."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a RAM tier needs at least one slot (got {num_slots})")
        self.num_slots = num_slots
        self._slot: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))

    def place(self, keys: Sequence[Hashable]) -> tuple[list[int], list[tuple[Hashable, int]]]:
        """The slot of each key, and the keys that were not resident with the slot they now own (to be filled).
        NOTE: the keys of one call never evict one another, so they must fit: at most `num_slots` distinct."""
        wanted = set(keys)
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} experts at once in a RAM tier of {self.num_slots} slots")
        slots, missed = [], []
        for key in keys:
            slot = self._slot.get(key)
            if slot is None:
                slot = self._free.pop() if self._free else self._evict(wanted)
                self._slot[key] = slot
                missed.append((key, slot))
            self._slot.move_to_end(key)
            slots.append(slot)
        return slots, missed

    def demote(self, keys: Sequence[Hashable]) -> None:
        """Resident keys become the first to be evicted."""
        for key in keys:
            if key in self._slot:
                self._slot.move_to_end(key, last=False)

    def forget(self, keys: Sequence[Hashable]) -> None:
        """Free the slots of keys whose bytes never arrived (a failed read)."""
        for key in keys:
            if (slot := self._slot.pop(key, None)) is not None:
                self._free.append(slot)

    def residents(self) -> dict[Hashable, int]:
        return dict(self._slot)

    def _evict(self, wanted: set[Hashable]) -> int:
        victim = next(key for key in self._slot if key not in wanted)
        return self._slot.pop(victim)


@dataclass(frozen=True)
class Extents:
    """Where a layer's experts lie in its file: for gate, up and down, the offset of expert 0's bytes, the
    stride from one expert to the next and the bytes of one expert's part."""

    path: Path
    offsets: tuple[int, ...]
    strides: tuple[int, ...]
    lengths: tuple[int, ...]

    @staticmethod
    def of(bank: ExpertWeights, locate: Callable[[int], tuple[Path, int]]) -> Extents:
        """`bank`: the layer's experts as views of the GGUF map (only their addresses are used, never their bytes)."""
        parts = (bank.gate, bank.up, bank.down)
        where = [locate(t.data_ptr()) for t in parts]
        if len({path for path, _ in where}) != 1:
            raise ValueError("a layer's expert tensors lie in different files of a split model")
        return Extents(where[0][0], tuple(offset for _, offset in where), tuple(t.stride(0) for t in parts),
                       tuple(t[0].numel() for t in parts))

    def ranges(self, expert: int) -> list[tuple[int, int]]:
        """(file offset, length) of the expert's gate, up and down bytes, in that order."""
        return [(o + expert * s, n) for o, s, n in zip(self.offsets, self.strides, self.lengths)]


class DiskReader:
    """Reads byte ranges of files into buffers with `os.preadv`, several in flight."""

    def __init__(self, num_threads: int = READ_THREADS) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="moecache-disk")
        self._fds: dict[Path, int] = {}

    def read(self, requests: Sequence[tuple[Path, int, list[memoryview]]]) -> int:
        """Each request: a file, an offset and buffers filled one after the other from there. Returns the reads."""
        for path, _, _ in requests:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
        futures = [self._pool.submit(_read_fully, self._fds[path], offset, buffers)
                   for path, offset, buffers in requests]
        return sum(f.result() for f in futures)

    def close(self) -> None:
        self._pool.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_fully(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """preadv until every buffer is full (a read may return less); returns the calls made."""
    calls = 0
    while buffers:
        got = os.preadv(fd, buffers, offset)
        calls += 1
        if got == 0:
            raise OSError(f"end of file at offset {offset}: the GGUF file is shorter than its tensors")
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers = buffers[1:]
        if buffers:
            buffers = [buffers[0][got:], *buffers[1:]]
    return calls


def coalesce(ranges: list[tuple[int, int]], buffers: list[memoryview]) -> list[tuple[int, list[memoryview]]]:
    """(offset, length) ranges and their buffers -> (offset, buffers) reads, adjacent ranges in one read."""
    reads: list[tuple[int, list[memoryview]]] = []
    end = -1
    for (offset, length), buffer in zip(ranges, buffers):
        if offset == end:
            reads[-1][1].append(buffer)
        else:
            reads.append((offset, [buffer]))
        end = offset + length
    return reads


def available_ram_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_host_cache_bytes() -> int:
    """`--host-cache-mib`'s default: half the available RAM at start-up (the rest for the page cache, the
    dense weights and everything else)."""
    return available_ram_bytes() // 2


def ram_tier_slots(budget_bytes: int, slot_bytes: int, num_experts: int) -> int:
    """The slots a budget buys: whole slots of the largest expert, no more than there are experts on disk."""
    return min(budget_bytes // slot_bytes, num_experts)


class RamTier:
    def __init__(self, layouts: Mapping[int, ExpertWeights], locate: Callable[[int], tuple[Path, int]],
                 budget_bytes: int, min_slots: int, stats: CacheStats, pin: bool = False) -> None:
        """layouts: each disk layer's experts as views of the GGUF map (shapes, types, math and file offsets).
        min_slots: the experts of a layer the tier must hold at once (a token's top-k, or a decode step's where the
        device streams them): a smaller tier is a startup error."""
        self.layouts, self.stats = layouts, stats
        self.extents = {layer: Extents.of(bank, locate) for layer, bank in layouts.items()}
        self.slot_bytes = max(bank.expert_bytes for bank in layouts.values())
        num_slots = ram_tier_slots(budget_bytes, self.slot_bytes, sum(b.num_experts for b in layouts.values()))
        if num_slots < min_slots:
            need = -(-min_slots * self.slot_bytes // MiB)
            raise ValueError(f"the host-RAM tier of {budget_bytes / MiB:.0f} MiB holds {num_slots} experts of "
                             f"{self.slot_bytes / MiB:.2f} MiB; a layer needs {min_slots} at once: "
                             f"give --host-cache-mib >= {need}")
        self.lru = SlotLru(num_slots)
        # NOTE: allocated once and never faulted in whole: a slot's pages are touched when it is first read into
        self.pool = torch.empty((num_slots, self.slot_bytes), dtype=torch.uint8, pin_memory=pin)
        self._bytes = self.pool.numpy()
        self.banks = {layer: self._bank_view(bank) for layer, bank in layouts.items()}
        self.reader = DiskReader()

    @property
    def num_slots(self) -> int:
        return self.lru.num_slots

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel()

    def _bank_view(self, like: ExpertWeights) -> ExpertWeights:
        """The pool as a bank of `like`'s types and shapes (rows are slots): gate, up, down one after the other."""
        parts, start = [], 0
        for t in (like.gate, like.up, like.down):
            shape = (self.num_slots, *t.shape[1:])
            parts.append(self.pool.as_strided(shape, (self.slot_bytes, t.shape[2], 1), start))
            start += t[0].numel()
        gate, up, down = parts
        return ExpertWeights(gate, up, down, like.gate_type, like.up_type, like.down_type, like.hidden, like.ff)

    def load(self, layer: int, experts: Sequence[int]) -> list[int]:
        """The slot of each (distinct) expert, read from the file where it was not in RAM.
        NOTE: the slots hold these experts until the next `load`: the caller computes from them before."""
        slots, missed = self.lru.place([(layer, e) for e in experts])
        requests = []
        for key, slot in missed:
            ranges = self.extents[layer].ranges(key[1])  # type: ignore[index]
            row, buffers, start = memoryview(self._bytes[slot]), [], 0
            for _, length in ranges:
                buffers.append(row[start:start + length])
                start += length
            requests += [(self.extents[layer].path, offset, bufs) for offset, bufs in coalesce(ranges, buffers)]
        try:
            reads = self.reader.read(requests)
        except BaseException:
            self.lru.forget([key for key, _ in missed])
            raise
        read_bytes = len(missed) * self.layouts[layer].expert_bytes
        self.stats.record_ram_tier(len(experts) - len(missed), len(missed), reads, read_bytes)
        return slots

    def keep(self, layer: int, evicted: Mapping[int, Sequence[torch.Tensor]],
             copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] = copy_pairs) -> None:
        """Experts of the layer the device cache evicted, each with its gate, up and down bytes there: they become the
        tier's most recent, copied (`copy`: the (dst, src) pairs, done when it returns) into a slot where the tier no
        longer held them, so that the tier holds what the device cache does not (exclusive of it:
        `.ci/ram-tier-replay.py`). NOTE: nothing may read the tier's slots meanwhile (the caller waits for the device
        first). More than the tier holds: the last of them."""
        _, missed = self.lru.place([(layer, e) for e in list(evicted)[-self.num_slots:]])
        bank, pairs = self.banks[layer], []
        for key, slot in missed:
            for into, part in zip((bank.gate[slot], bank.up[slot], bank.down[slot]), evicted[key[1]]):  # type: ignore[index]
                pairs.append((into, part.reshape(into.shape)))
        copy(pairs)
        self.stats.record_ram_tier_kept(len(missed))

    def let_go(self, layer: int, experts: Sequence[int]) -> None:
        """Experts the device cache now holds: the tier evicts them first."""
        self.lru.demote([(layer, e) for e in experts])

    def bank(self, layer: int, experts: Sequence[int], slots: Sequence[int]) -> ExpertWeights:
        """The pool as the layer's bank, with the layer's math at the slots holding `experts`."""
        bank, math = self.banks[layer], self.layouts[layer].math
        if math.is_plain:
            return bank
        source = torch.full((self.num_slots,), -1, dtype=torch.int64)
        source[list(slots)] = torch.tensor(list(experts), dtype=torch.int64)
        return replace(bank, math=math.at_rows(source))

    def ffn(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """`ops.expert_ffn.expert_ffn` over the layer's experts, read through the tier (pairs of expert -1
        skipped); more distinct experts than slots are computed a slot-pool's worth at a time."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        keep = expert_ids >= 0
        token_ids, expert_ids, weights = token_ids[keep], expert_ids[keep], weights[keep]
        distinct = expert_ids.unique().tolist()
        for i in range(0, len(distinct), self.num_slots):
            chunk = distinct[i:i + self.num_slots]
            slots = self.load(layer, chunk)
            row_of = torch.full((self.layouts[layer].num_experts,), -1, dtype=torch.int64)
            row_of[chunk] = torch.tensor(slots, dtype=torch.int64)
            rows = row_of[expert_ids]
            pick = rows >= 0
            out += expert_ffn(x, token_ids[pick], rows[pick], weights[pick], self.bank(layer, chunk, slots))
        return out

    def addresses(self, layer: int, slots: Sequence[int]) -> torch.Tensor:
        """int64 `[3, len(slots)]`: where the gate, up and down bytes of the layer's experts in `slots` lie in host
        memory (the device's host pointer table, `SlotTables.host`, points there on CUDA)."""
        rows = torch.tensor(list(slots), dtype=torch.int64)
        bank = self.banks[layer]
        return torch.stack([t.data_ptr() + rows * t.stride(0) for t in (bank.gate, bank.up, bank.down)])

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expert's gate, up and down bytes in its RAM slot (read if needed; valid until the next `load`)."""
        slot, bank = self.load(layer, [expert])[0], self.banks[layer]
        return bank.gate[slot], bank.up[slot], bank.down[slot]

    def describe(self) -> str:
        return (f"host-RAM tier {self.pool_bytes / MiB:.0f} MiB: {self.num_slots} slots of "
                f"{self.slot_bytes / MiB:.2f} MiB for {len(self.layouts)} layers on disk")

    def close(self) -> None:
        self.reader.close()
