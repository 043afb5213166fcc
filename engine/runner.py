"""Runs a step's forward pass: eagerly, or, for decode batches on CUDA whose experts are computed without
a host sync, by replaying a CUDA graph captured per padded batch size and KV-length bucket. A step is
the expert dispatcher's `begin_step`, the model's forward and the dispatcher's `end_step`, captured
together: the cache's table changes and the step record are part of the graph."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.expert_cache.dispatch import ExpertDispatcher
from engine.kv_cache import KVCache
from engine.model import ForwardBatch, Model, SeqSpan

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def length_buckets(max_len: int) -> list[int]:
    """KV lengths graphs are captured for: 256, 1024, 4096, ... and the slot length."""
    buckets, n = [], 256
    while n < max_len:
        buckets.append(n)
        n *= 4
    return [*buckets, max_len]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static input buffers: input_ids, positions, slot_ids are the rows of `inputs`
    inputs: torch.Tensor  # [3, size] int64 on the device
    staged: torch.Tensor  # [3, size] int64 pinned host memory: the next step's inputs, one copy
    logits: torch.Tensor  # static output


class ModelRunner:
    def __init__(self, model: Model, kv: KVCache, experts: ExpertDispatcher, max_num_seqs: int,
                 use_graphs: bool) -> None:
        self.model, self.kv, self.experts = model, kv, experts
        self.scratch_slot = kv.num_slots - 1  # padding rows write their KV here
        self.sizes = [b for b in BATCH_SIZES if b <= max_num_seqs]
        self.buckets = length_buckets(kv.max_len)
        self.use_graphs = use_graphs and model.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def can_replay(self, spans: list[SeqSpan]) -> bool:
        return (self.use_graphs and self.experts.is_graph_safe and len(spans) <= self.sizes[-1]
                and all(s.num_tokens == 1 for s in spans))

    def forward(self, spans: list[SeqSpan], token_ids: list[list[int]],
                logits_from: list[int] | None = None) -> torch.Tensor:
        """Logits `[seqs, vocab]` of each sequence's last token, or of more rows (`logits_from`, see
        `ForwardBatch.build`: such a step runs eagerly); launched, not synchronized."""
        if logits_from is None and self.can_replay(spans):
            return self._replay(spans, token_ids)
        return self._step(ForwardBatch.build(spans, token_ids, self.model.device, logits_from))

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.token_mask is not None:  # a captured batch: its padding rows write the scratch slot
            torch.ne(batch.slot_ids, self.scratch_slot, out=batch.token_mask)
        self.experts.begin_step(batch.num_tokens)
        logits = self.model.forward(batch, self.kv)
        self.experts.end_step()
        return logits

    def _replay(self, spans: list[SeqSpan], token_ids: list[list[int]]) -> torch.Tensor:
        n = len(spans)
        size = next(b for b in self.sizes if b >= n)
        length = next(x for x in self.buckets if x >= max(s.end for s in spans))
        g = self._graph(size, length)
        # NOTE: the previous step's copy out of `staged` has completed: its tokens were sampled on the host
        staged = g.staged.numpy()
        staged[0, :n] = [ids[0] for ids in token_ids]
        staged[1, :n] = [s.start for s in spans]
        staged[2, :n] = [s.slot for s in spans]
        staged[:, n:] = np.array([[0], [0], [self.scratch_slot]])
        g.inputs.copy_(g.staged, non_blocking=True)  # one copy; the graph derives the token mask
        g.graph.replay()
        self.experts.replayed(n, size)
        return g.logits[:n]

    def capture_all(self) -> int:
        """Capture the graph of every padded batch size and KV bucket now, so that no request pays a capture;
        returns how many there are (0 where steps are not captured)."""
        if not self.use_graphs or not self.experts.is_graph_safe:
            return 0
        for size in self.sizes:
            for length in self.buckets:
                self._graph(size, length)
        return len(self.graphs)

    def _graph(self, size: int, length: int) -> _Graph:
        if (size, length) not in self.graphs:
            self.graphs[(size, length)] = self._capture(size, length)
        return self.graphs[(size, length)]

    def _capture(self, size: int, length: int) -> _Graph:
        device = self.model.device
        inputs = torch.zeros((3, size), dtype=torch.int64, device=device)
        inputs[2] = self.scratch_slot
        batch = ForwardBatch(inputs[0], inputs[1], inputs[2],
                             tuple(SeqSpan(self.scratch_slot, 0, 1) for _ in range(size)),
                             torch.arange(size, device=device), length,
                             torch.zeros(size, dtype=torch.bool, device=device))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # NOTE: the warm-up steps route nowhere (every row is padding): they change no cache state beyond
        # applying the pending table changes, which the replay applies again (the same values)
        with torch.cuda.stream(side):  # warm-up: compile kernels, create handles, outside the capture
            for _ in range(2):
                self._step(batch)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(batch)
        return _Graph(graph, batch, inputs, torch.empty((3, size), dtype=torch.int64).pin_memory(), logits)
