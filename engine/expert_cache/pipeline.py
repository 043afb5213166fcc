"""The expert dispatcher of a model split across devices (`engine.layer_split`): one `ExpertDispatcher` a device, over
that device's MoE layers, with its own cache manager (slot pools, tables, policies, copy stream), step record and
staging; the CPU computes the misses of any of them (one `CpuTasks`). The model's call for a layer goes to the
dispatcher of the layer's device; the step's records, each holding its own layers' rows, are taken as one.

NOTE: a step that spans several CUDA devices runs eagerly (`is_graph_safe` is False): a CUDA graph is captured on one
device's stream, and the hand-offs between the devices and each device's own cache steps would need a graph a device
joined by events. The one-device path keeps its graphs (it has no `PipelineDispatcher`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.dispatch import ExpertDispatcher, StepTicket
from engine.expert_cache.record import StepRecord
from engine.layers import use_device
from ops.bank import ExpertWeights


class PipelineDispatcher:
    def __init__(self, parts: Sequence[ExpertDispatcher]) -> None:
        self.parts = tuple(parts)
        self.part_of = {layer: part for part in self.parts for layer in (*part.host, *part.resident)}
        self.cfg: CacheConfig = self.parts[0].cfg
        self.rows = self.parts[0].rows  # every part's: a row per MoE layer of the model
        self.host: dict[int, ExpertWeights] = {x: bank for part in self.parts for x, bank in part.host.items()}
        self.resident: dict[int, ExpertWeights] = {x: bank for part in self.parts for x, bank in part.resident.items()}
        self._own_rows = [np.array([self.rows[x] for x in (*part.host, *part.resident)], dtype=np.int64)
                          for part in self.parts]

    is_graph_safe = False
    prompt_is_graph_safe = False

    def prepare(self) -> None:
        for part in self.parts:
            part.prepare()

    def begin_step(self, num_tokens: int) -> None:
        for part in self.parts:
            use_device(part.device)  # NOTE: kernels launch on the current device
            part.begin_step(num_tokens)

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[tokens, hidden]`, expert_ids and weights `[tokens, top_k]` (on the layer's device, the current one:
        `Model.hand_off`) -> `sum_k w * expert_k(x)`."""
        return self.part_of[layer](layer, x, expert_ids, weights)

    def end_step(self) -> None:
        for part in self.parts:
            use_device(part.device)
            part.end_step()

    def launched(self) -> StepTicket:
        """Each device's record copied to the host, ordered after the step on that device; the parts step together,
        so one ticket names every part's copy."""
        tickets = []
        for part in self.parts:
            use_device(part.device)
            tickets.append(part.launched())
        assert all(t == tickets[0] for t in tickets), "the devices' dispatchers step together"
        return tickets[0]

    def replayed(self, num_tokens: int, padded: int, prefill: bool = False) -> None:
        for part in self.parts:
            part.replayed(num_tokens, padded, prefill)

    def take_record(self, ticket: StepTicket) -> StepRecord:
        """A finished step's record: each device's rows from its own record."""
        records = [part.take_record(ticket) for part in self.parts]
        merged = records[0]
        for rows, record in zip(self._own_rows[1:], records[1:], strict=True):
            for mine, theirs in ((merged.ids, record.ids), (merged.outcome, record.outcome),
                                 (merged.slot, record.slot)):
                mine[rows] = theirs[rows]
        return merged
