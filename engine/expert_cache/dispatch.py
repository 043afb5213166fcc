"""The expert dispatcher: what the model calls for every MoE layer. It computes each (token, expert) pair
of the step exactly once: resident layers on the device; host layers' hits from their cache slots,
misses streamed by the device (copied from pinned host memory inside the expert kernels, landing in a
free slot when the policy offered one) or computed by the CPU (a task the device rings for, beside its own work).

The step kind is decided once per step: a decode step (up to `max_cached_batch` tokens) uses the cache
as above, with no host sync, so it is captured as one CUDA graph; a larger batch (a prompt) stages
whole host layers in VRAM and reads the cache without changing it. Everything a step decided is in its
record (`record.py`), which `launched` copies to the host just after the step: the step's `StepTicket` says
where, so that its record is taken right even after a later step was launched.

Layers on disk (`--ssd-moe`, `ram_tier.py`): on CUDA, a decode step syncs once per such layer, after its router,
reads the experts no slot holds into the host-RAM tier and points the device's host table at their RAM slots
before the layer's kernels stream them; a prompt stages only the experts it uses, read through the tier. Such
steps are not captured.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from engine.config import CacheConfig
from engine.expert_cache.cpu_tasks import CpuTasks
from engine.expert_cache.device import LinkCap, expert_parts
from engine.expert_cache.manager import CacheManager
from engine.expert_cache.ram_tier import RamTier
from engine.expert_cache.record import HIT, LANDED, ON_CPU, STAGED, RecordBuffers, StepRecord
from engine.expert_cache.staging import LayerStager
from engine.moe import flatten_pairs
from ops.bank import ExpertWeights
from ops.cache_step import assign_experts, begin_step, record_prompt
from ops.expert_ffn import expert_ffn
from ops.grouped_gemm import expert_ffn_grouped_gemm, grouped_gemm_available


class StepKind(enum.Enum):
    DECODE = "decode"  # the cache serves, misses land
    PREFILL = "prefill"  # host layers staged whole; the cache is read, never changed


@dataclass(frozen=True)
class StepTicket:
    """A launched step, for taking its record once it has finished: its kind, tokens and pairs, and the host copy
    of its record."""

    is_prefill: bool
    num_tokens: int
    pairs: int
    turn: int
    began: float = 0.0  # when it was prepared (`ExpertCache.prepare_step`)


class ExpertDispatcher:
    def __init__(self, host: Mapping[int, ExpertWeights], resident: Mapping[int, ExpertWeights],
                 manager: CacheManager, cfg: CacheConfig, device: torch.device, moe_layers: list[int], top_k: int,
                 max_tokens: int, cpu: CpuTasks | None, on_device: bool, cap: LinkCap | None = None,
                 tier: RamTier | None = None) -> None:
        """tier: the layers of `host` whose experts are on disk (their banks there are the map's views, never read)."""
        self.host, self.resident, self.manager, self.cfg, self.device = host, resident, manager, cfg, device
        self.tier = tier
        self.mode, self.top_k, self.cpu, self.cap = cfg.mode, top_k, cpu, cap
        self.rows = {layer: i for i, layer in enumerate(moe_layers)}
        self.record = RecordBuffers(len(moe_layers), max_tokens * top_k, device)
        resident_rows = [self.rows[layer] for layer in sorted(resident)]
        self.resident_rows = torch.tensor(resident_rows, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.header = torch.zeros(2, dtype=torch.int64, pin_memory=pin)  # changes, previous step's pairs
        self.changes = torch.zeros((manager.max_changes, 4), dtype=torch.int64, pin_memory=pin)
        self._header_np, self._changes_np = self.header.numpy(), self.changes.numpy()  # written by the host
        self.on_device = on_device  # the Triton kernels (CUDA); else torch references and the CPU kernels
        self.stager = LayerStager(host, manager.pools, manager.group_of, manager.slots_of, manager.copies, tier,
                                  in_place=self._prompts_read_tables(), spare_bytes=cfg.headroom_mib << 20) \
            if on_device and host else None
        self.kind, self.pairs, self.num_tokens, self.previous_pairs = StepKind.DECODE, 0, 0, 0
        self._resident_ids: list[torch.Tensor] = []
        if on_device:
            self._device_tables()

    def _device_tables(self) -> None:
        from ops.triton import ExpertTables, Fill, tables_from_bank  # Triton: CUDA only
        from ops.triton.experts import gate_format

        t = self.manager.tables
        self.resident_tables = {layer: tables_from_bank(bank, self.device) for layer, bank in self.resident.items()}

        def view(ptrs: torch.Tensor, bank: ExpertWeights) -> ExpertTables:
            # NOTE: the tables are indexed by expert id, like the host bank's math
            return ExpertTables(ptrs[0], ptrs[1], ptrs[2], bank.gate_type, bank.up_type, bank.down_type,
                                bank.hidden, bank.ff, bank.math.to(self.device))

        self.cur = {layer: view(t.cur[self.rows[layer]], bank) for layer, bank in self.host.items()}
        self.gate_format = {layer: gate_format(tables) for layer, tables in self.cur.items()}
        self.fill = {layer: Fill(t.fill[self.rows[layer]], view(t.host[self.rows[layer]], bank))
                     for layer, bank in self.host.items()} if self.mode.streams else {}

    @property
    def is_graph_safe(self) -> bool:
        """A decode step makes no host sync: it can be captured as a CUDA graph (never with layers on disk)."""
        return self.on_device and (self.cpu is None or self.cpu.rings) and self.tier is None

    @property
    def prompt_is_graph_safe(self) -> bool:
        """A prompt's step makes no host sync either: every routed expert resident (a host layer's prompt stages its
        experts), computed by kernels that size nothing on the host (the fused prefill GEMMs, `ops.triton.moe_gemm`,
        for each bank's formats; or the decode kernels where the tensor cores do not take the prompt)."""
        if not self.is_graph_safe or self.host:
            return False
        from ops.grouped_gemm import prefill_experts
        from ops.triton.moe_gemm import covers
        return prefill_experts() == "fused" and all(covers(bank) for bank in self.resident.values())

    # -- the host, before a step is launched ------------------------------------------------------------
    def prepare(self) -> None:
        """The manager's table changes and the previous step's landings for the next `begin_step` (pinned memory
        the device reads when the step runs; the previous step has finished)."""
        changes = self.manager.changes()
        if len(changes) > self.changes.shape[0]:
            raise RuntimeError(f"{len(changes)} cache table changes in one step (room for {self.changes.shape[0]})")
        if changes:
            self._changes_np[:len(changes)] = changes
        self._header_np[:] = len(changes), self.previous_pairs

    # -- the step: inside the forward pass, captured in graphs -----------------------------------------
    def begin_step(self, num_tokens: int) -> None:
        self.kind = StepKind.PREFILL if num_tokens > self.cfg.max_cached_batch else StepKind.DECODE
        self.num_tokens, self.pairs = num_tokens, num_tokens * self.top_k
        self._resident_ids = []
        begin_step(self.manager.tables, self.record.device, self.header, self.changes)
        self.record.reset(self.pairs)  # after the landings of the last step are published

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[tokens, hidden]`, expert_ids and weights `[tokens, top_k]` -> `sum_k w * expert_k(x)`."""
        if layer in self.resident:
            self._resident_ids.append(expert_ids)
            return self._resident_ffn(layer, x, expert_ids, weights)
        if self.kind is StepKind.PREFILL:
            return self._prefill(layer, x, expert_ids, weights)
        return self._decode(layer, x, expert_ids, weights)

    def end_step(self) -> None:
        if self.stager is not None and self.kind is StepKind.PREFILL:
            self.stager.finish()
        if self._resident_ids:
            ids = torch.stack([i.flatten() for i in self._resident_ids], dim=1).to(torch.int32)  # [pairs, layers]
            self.record.device[:self.pairs, 0, self.resident_rows] = ids

    def launched(self) -> StepTicket:
        """Just after a step's launch (outside any graph): its record's copy to the host, ordered after it."""
        turn = self.record.copy_to_host(self.pairs)
        return StepTicket(self.kind is StepKind.PREFILL, self.num_tokens, self.pairs, turn)

    def replayed(self, num_tokens: int, padded: int, prefill: bool = False) -> None:
        """A captured step of `padded` tokens (a decode step's, or a prompt's first chunk) ran for `num_tokens`."""
        self.kind = StepKind.PREFILL if prefill else StepKind.DECODE
        self.num_tokens, self.pairs = num_tokens, padded * self.top_k

    def take_record(self, ticket: StepTicket) -> StepRecord:
        """A finished step's record; remembers its landings for the next step."""
        self.previous_pairs = 0 if ticket.is_prefill else ticket.pairs
        return self.record.take(ticket.turn, ticket.pairs, ticket.num_tokens, ticket.is_prefill)

    # -- paths ----------------------------------------------------------------------------------------------
    def _tensor_cores(self, x: torch.Tensor) -> bool:
        """A prefill's experts as bf16 grouped GEMMs (`ops.grouped_gemm`). NOTE: not for float32 activations: a
        float32 model's prefill would compute its experts in bf16 and write K and V of its prompt from them."""
        return x.dtype != torch.float32 and grouped_gemm_available(self.device)

    def _prompts_read_tables(self) -> bool:
        """Whether a prompt's host layers are computed by kernels that find each expert through its address (so a
        staged layer's cached experts stay in their slots): the fused prefill GEMMs for the host banks' formats, or
        the decode kernels where the tensor cores do not take prompts. Else the dequantizing grouped GEMM reads
        whole banks."""
        if not self.on_device or not self.host:
            return False
        from ops.grouped_gemm import prefill_experts
        from ops.triton.moe_gemm import covers
        return not grouped_gemm_available(self.device) or \
            (prefill_experts() == "fused" and all(covers(bank) for bank in self.host.values()))

    def _resident_ffn(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        bank = self.resident[layer]
        if not self.on_device:
            return expert_ffn(x, *flatten_pairs(expert_ids, weights), bank).to(x.dtype)
        if self.kind is StepKind.PREFILL and self._tensor_cores(x):
            return expert_ffn_grouped_gemm(x, *flatten_pairs(expert_ids, weights), bank).to(x.dtype)
        from ops.triton import grouped_expert_ffn
        tokens, experts, pair_weights = flatten_pairs(expert_ids, weights)
        return grouped_expert_ffn(x, tokens, experts, pair_weights, self.resident_tables[layer], torch.empty_like(x))

    def _decode(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        row = self.rows[layer]
        job = self.cpu.job if self.cpu is not None else None
        # NOTE: exactly once: each pair is a hit, streamed (filled, maybe landing) or the CPU's, never two
        args = (row, expert_ids, weights, x, self.manager.tables, self.record.layer(row), self.mode.streams, job)
        if not self.on_device:
            assign_experts(*args)
            return self._decode_in_place(layer, x, expert_ids, weights)
        from ops.triton import grouped_expert_ffn, hold_fills
        from ops.triton.cache_step import assign_experts as assign_on_device
        if self.mode.streams and self._on_disk(layer):
            self.read_disk_misses(layer, expert_ids)
        prepared = assign_on_device(*args, prepare=self.gate_format[layer])  # x for the expert kernels too
        if self.cap is not None and layer in self.fill:
            hold_fills(expert_ids.reshape(-1), self.fill[layer].flags,
                       self.cap.extra_ns(self.host[layer].expert_bytes))
        added = None  # the CPU's job whose output the kernels add
        if self.cpu is not None and (self.cpu.rings or self._has_cpu_pairs(row, expert_ids.numel())):
            self.cpu.launch(layer, self.device)
            added = self.cpu.job
        tokens, experts, pair_weights = flatten_pairs(expert_ids, weights)
        return grouped_expert_ffn(x, tokens, experts, pair_weights, self.cur[layer], torch.empty_like(x),
                                  fill=self.fill.get(layer), extra=added.out if added is not None else None,
                                  extra_bell=added.bell if added is not None else None, prepared=prepared)

    def _has_cpu_pairs(self, row: int, num_pairs: int) -> bool:
        """Whether the layer's assignment gave the CPU any pair: a host sync, for the steps whose CPU tasks run after
        one (no doorbell). NOTE: a layer without CPU pairs writes no job, so the job holds an earlier layer's: its
        task must not run, nor its output be added (a ringing device's kernel reads that from the doorbell)."""
        return bool((self.record.layer(row)[:num_pairs, 1] == ON_CPU).any())

    def _decode_in_place(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        """The decode step where the device is the CPU: host memory is the device's, so staged misses are
        read in place and a landing is a copy of the expert into its slot."""
        row, n = self.rows[layer], expert_ids.numel()
        outcome, slot = (self.record.layer(row)[:n, i].long() for i in (1, 2))
        tokens, experts, pair_weights = flatten_pairs(expert_ids, weights)
        host, pool = self.host[layer], self.manager.pools.get(self.manager.group_of[layer])
        landed = outcome == LANDED
        for e, s in set(zip(experts[landed].tolist(), slot[landed].tolist())):
            assert pool is not None, "landings are in a cached group's pool"
            for dst, src in zip(expert_parts(pool, s), self._host_expert(layer, e)):
                dst.copy_(src)
        out = torch.zeros(x.shape, dtype=torch.float32)
        in_pool = (outcome == HIT) | (outcome == LANDED)
        if bool(in_pool.any()):
            assert pool is not None, "hits and landings are in a cached group's pool"
            out += expert_ffn(x, tokens[in_pool], slot[in_pool], pair_weights[in_pool],
                              self._pool_bank(pool, host, slot[in_pool], experts[in_pool]))
        staged = outcome == STAGED
        if bool(staged.any()):
            out += self._host_ffn(layer, x, tokens[staged], experts[staged], pair_weights[staged])
        if self.cpu is not None and bool((outcome == ON_CPU).any()):
            self.cpu.run(layer)
            out += self.cpu.job.out[:x.shape[0]]
        return out.to(x.dtype)

    def _on_disk(self, layer: int) -> bool:
        return self.tier is not None and layer in self.tier.layouts

    def read_disk_misses(self, layer: int, expert_ids: torch.Tensor) -> None:
        """A disk layer's decode step on CUDA, before its kernels: the selected experts no slot holds are read into
        the host-RAM tier (once: those already in RAM are hits), and the device's host table (`SlotTables.host`)
        points at their RAM slots, where the kernels stream them from. One host sync.
        NOTE: the sync also means every kernel queued before (an earlier layer's, reading RAM slots) has finished,
        so the tier may refill a slot; and the pairs the CPU computes (hybrid) find their experts in RAM."""
        assert self.tier is not None, "a layer on disk has a tier"
        row, tables = self.rows[layer], self.manager.tables
        ids = expert_ids.flatten().unique()
        ids = ids[ids >= 0]
        missed = ids[tables.state[row][ids] < 0].tolist()  # the slots as this step's `begin_step` left them
        if missed:
            slots = self.tier.load(layer, missed)
            tables.host[row][:, missed] = self.tier.addresses(layer, slots).to(tables.host.device)

    def _host_ffn(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """Pairs computed from host memory where the device is the CPU: a disk layer's through the RAM tier."""
        if self.tier is not None and layer in self.tier.layouts:
            return self.tier.ffn(layer, x, token_ids, expert_ids, weights)
        return expert_ffn(x, token_ids, expert_ids, weights, self.host[layer])

    def _host_expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An expert's gate, up and down bytes in host memory (a disk layer's: in its RAM slot, read if needed)."""
        if self.tier is not None and layer in self.tier.layouts:
            return self.tier.expert(layer, expert)
        return expert_parts(self.host[layer], expert)

    @staticmethod
    def _pool_bank(pool: ExpertWeights, host: ExpertWeights, slots: torch.Tensor,
                   experts: torch.Tensor) -> ExpertWeights:
        """The pool with the layer's math for the slots the pairs read (rows are slots, not experts)."""
        if host.math.is_plain:
            return pool
        expert_of_slot = torch.full((pool.num_experts,), -1, dtype=torch.int64)
        expert_of_slot[slots] = experts
        return replace(pool, math=host.math.at_rows(expert_of_slot))

    def _prefill(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A large batch: the layer's uncached experts staged in VRAM, its cached ones read in their slots (or copied
        from there beside them, `LayerStager.in_place`) or, where the device is the CPU, read in place. The cache is
        read, never changed."""
        row = self.rows[layer]
        record_prompt(row, expert_ids, self.manager.tables, self.record.layer(row))
        if not self.on_device:
            return self._host_ffn(layer, x, *flatten_pairs(expert_ids, weights)).to(x.dtype)
        assert self.stager is not None, "the device stages host layers for large batches"
        used = expert_ids[expert_ids >= 0].unique().tolist() if self._on_disk(layer) else None  # a host sync
        bank = self.stager.bank(layer, used)
        tables, pairs = self.stager.tables(layer, bank), flatten_pairs(expert_ids, weights)
        if self._tensor_cores(x) and self.stager.in_place:
            from ops.triton.moe_gemm import expert_ffn_moe_gemm
            out = expert_ffn_moe_gemm(x, *pairs, tables, pairs_per_token=expert_ids.shape[1])
        elif self._tensor_cores(x):
            out = expert_ffn_grouped_gemm(x, *pairs, replace(bank, math=tables.math))
        else:
            from ops.triton import grouped_expert_ffn
            out = grouped_expert_ffn(x, *pairs, tables)
        self.stager.release(bank)
        return out.to(x.dtype)
