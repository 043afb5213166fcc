"""Runs a step's forward pass: eagerly, or, on CUDA where the experts are computed without a host sync, by
replaying a CUDA graph: decode batches per padded batch size and KV-length bucket, and a prompt's first chunk alone
(every routed expert resident, the model's router) per padded chunk size, so that a prompt is not bound by the host's
launches (a 512-token prompt's 2,769 kernels took 33.5 ms on an H100 and their launches 75-90 ms: docs/benchmarks.md).
A step is the expert dispatcher's `begin_step`, the model's forward and the dispatcher's `end_step`, captured
together: the cache's table changes and the step record are part of the graph."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from engine.expert_cache.dispatch import ExpertDispatcher
from engine.expert_cache.pipeline import PipelineDispatcher
from engine.kv_cache import KVCache
from engine.model import ForwardBatch, Model, SeqSpan
from engine.moe import TopKRouter

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
CHUNK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # a prompt's first chunk is padded to the next (and the budget)
CHUNK_GRAPHS = os.environ.get("MOECACHE_CHUNK_GRAPHS", "1") != "0"  # 0: every prompt step eager (timings, A/B)


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
    copied: torch.cuda.Event  # the last copy out of `staged`: waited for before it is written again


class ModelRunner:
    def __init__(self, model: Model, kv: KVCache, experts: ExpertDispatcher | PipelineDispatcher, max_num_seqs: int,
                 use_graphs: bool, max_chunk: int = 0) -> None:
        """max_chunk: the most tokens of a step (the scheduler's budget): the largest chunk graph."""
        self.model, self.kv, self.experts = model, kv, experts
        self.scratch_slot = kv.num_slots - 1  # padding rows write their KV here
        self.sizes = [b for b in BATCH_SIZES if b <= max_num_seqs]
        self.buckets = length_buckets(kv.max_len)
        self.use_graphs = use_graphs and model.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.chunk_graphs: dict[int, _Graph] = {}
        self.chunk_sizes = chunk_sizes(experts.cfg.max_cached_batch, min(max_chunk, kv.max_len)) \
            if self.use_graphs and CHUNK_GRAPHS and self.captures_chunks() else []
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def captures_chunks(self) -> bool:
        """Whether a prompt's first chunk can be one graph: its experts computed with no host sync
        (`ExpertDispatcher.prompt_is_graph_safe`), the model's own router (a benchmark's routes a step's tokens on the
        host), attention over the chunk's own keys and values (`ForwardBatch.fresh`), kept unquantized (so the chunk's
        later tokens read what it attended to)."""
        return (self.experts.prompt_is_graph_safe and isinstance(self.model.router, TopKRouter)
                and self.model.attends_chunks_alone and self.kv.qtypes == (None, None))

    def can_replay(self, spans: list[SeqSpan]) -> bool:
        return (self.use_graphs and self.experts.is_graph_safe and len(spans) <= self.sizes[-1]
                and all(s.num_tokens == 1 for s in spans))

    def chunk_size(self, spans: list[SeqSpan]) -> int | None:
        """The chunk graph of a step that is one prompt's first chunk of more tokens than a decode step's; None."""
        if len(spans) != 1 or spans[0].start or spans[0].num_tokens <= self.experts.cfg.max_cached_batch:
            return None
        return next((size for size in self.chunk_sizes if size >= spans[0].num_tokens), None)

    def forward(self, spans: list[SeqSpan], token_ids: list[list[int]], logits_from: list[int] | None = None,
                feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[seqs, vocab]` of each sequence's last token, or of more rows (`logits_from`, see
        `ForwardBatch.build`: such a step runs eagerly); launched, not synchronized. `feed`: a decode step whose
        tokens are on the device (the last step's sampled tokens, `LLMEngine`'s decode ahead): each of `token_ids`
        is then a row of `feed`, and the step's input ids are gathered there."""
        if logits_from is None and self.can_replay(spans):
            return self._replay(spans, token_ids, feed)
        if feed is None and logits_from is None and (size := self.chunk_size(spans)) is not None:
            return self._replay_chunk(spans[0], token_ids[0], size)
        batch = ForwardBatch.build(spans, token_ids, self.model.device, logits_from)
        if feed is not None:
            batch.input_ids.copy_(feed[batch.input_ids])
        return self._step(batch)

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.token_mask is not None:  # a captured batch: its padding rows write the scratch slot
            torch.ne(batch.slot_ids, self.scratch_slot, out=batch.token_mask)
            if batch.fresh:  # a chunk's logits are its last real row's
                torch.sub(batch.token_mask.sum(0, keepdim=True, dtype=torch.int64), 1, out=batch.logit_rows)
        self.experts.begin_step(batch.num_tokens)
        logits = self.model.forward(batch, self.kv)
        self.experts.end_step()
        return logits

    def _replay(self, spans: list[SeqSpan], token_ids: list[list[int]], feed: torch.Tensor | None) -> torch.Tensor:
        n = len(spans)
        size = next(b for b in self.sizes if b >= n)
        length = next(x for x in self.buckets if x >= max(s.end for s in spans))
        g = self._graph(size, length)
        g.copied.synchronize()  # NOTE: a step launched ahead: the last copy out of `staged` may not have run yet
        staged = g.staged.numpy()
        staged[0, :n] = [ids[0] for ids in token_ids]
        staged[1, :n] = [s.start for s in spans]
        staged[2, :n] = [s.slot for s in spans]
        staged[:, n:] = np.array([[0], [0], [self.scratch_slot]])
        g.inputs.copy_(g.staged, non_blocking=True)  # one copy; the graph derives the token mask
        g.copied.record()
        if feed is not None:
            g.inputs[0, :n] = feed[g.inputs[0, :n]]
        g.graph.replay()
        self.experts.replayed(n, size)
        return g.logits[:n]

    def _replay_chunk(self, span: SeqSpan, token_ids: list[int], size: int) -> torch.Tensor:
        g = self._chunk_graph(size)
        if g is None:
            return self._step(ForwardBatch.build([span], [token_ids], self.model.device))
        g.copied.synchronize()
        stage_chunk(g.staged.numpy(), span, token_ids, self.scratch_slot)
        g.inputs.copy_(g.staged, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        self.experts.replayed(span.num_tokens, size, prefill=True)
        return g.logits

    def capture_all(self) -> int:
        """Capture the graph of every padded batch size and KV bucket now, so that no request pays a capture;
        returns how many there are (0 where steps are not captured)."""
        if not self.use_graphs or not self.experts.is_graph_safe:
            return 0
        for size in self.sizes:
            for length in self.buckets:
                self._graph(size, length)
        for size in list(self.chunk_sizes):
            self._chunk_graph(size)
        return len(self.graphs) + len(self.chunk_graphs)

    def _chunk_graph(self, size: int) -> _Graph | None:
        """The chunk graph of `size` tokens, captured now if need be; None where a capture failed (then every prompt
        runs eagerly, as it did before these graphs: a kernel of the prompt's path that a capture refuses must not
        fail the request)."""
        if size not in self.chunk_graphs and size in self.chunk_sizes:
            try:
                self.chunk_graphs[size] = self._capture_chunk(size)
            except RuntimeError as exc:
                log.warning("a prompt chunk of %d tokens could not be captured as a CUDA graph (%s): prompts run "
                            "eagerly", size, exc)
                self.chunk_sizes = []
        return self.chunk_graphs.get(size)

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
        graph, logits = self._record(batch)
        return _Graph(graph, batch, inputs, torch.empty((3, size), dtype=torch.int64).pin_memory(), logits,
                      torch.cuda.Event())

    def _capture_chunk(self, size: int) -> _Graph:
        inputs, batch = chunk_batch(size, self.scratch_slot, self.model.device)
        staged = torch.empty((3, size), dtype=torch.int64).pin_memory()
        staged[1] = torch.arange(size)  # positions 0.. (a first chunk's), never restaged
        graph, logits = self._record(batch)
        return _Graph(graph, batch, inputs, staged, logits, torch.cuda.Event())

    def _record(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.model.device
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
        return graph, logits


def chunk_sizes(max_cached_batch: int, max_chunk: int) -> list[int]:
    """The padded sizes of first-chunk graphs: `CHUNK_SIZES` above a decode step's most tokens (smaller chunks use
    the cache as decode steps do) up to the step's budget, and the budget itself."""
    sizes = [size for size in CHUNK_SIZES if max_cached_batch < size < max_chunk]
    return [*sizes, max_chunk] if max_chunk > max_cached_batch else sizes


def chunk_batch(size: int, scratch_slot: int, device: torch.device) -> tuple[torch.Tensor, ForwardBatch]:
    """A first-chunk graph's static inputs `[3, size]` (ids, positions, slots) and the batch over their rows: `size`
    rows of padding (they write the scratch slot) until staged."""
    inputs = torch.zeros((3, size), dtype=torch.int64, device=device)
    inputs[1] = torch.arange(size, device=device)
    inputs[2] = scratch_slot
    return inputs, ForwardBatch(inputs[0], inputs[1], inputs[2], (SeqSpan(scratch_slot, 0, size),),
                                torch.zeros(1, dtype=torch.int64, device=device), size,
                                torch.zeros(size, dtype=torch.bool, device=device), fresh=True)


def stage_chunk(staged: np.ndarray, span: SeqSpan, token_ids: list[int], scratch_slot: int) -> None:
    """A first chunk's ids and slot into a chunk graph's `[3, size]` inputs (positions stay 0..size-1); the rows
    after it are padding: the scratch slot, no expert."""
    n = span.num_tokens
    staged[0, :n], staged[0, n:] = token_ids, 0
    staged[2, :n], staged[2, n:] = span.slot, scratch_slot
