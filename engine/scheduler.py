"""Continuous batching, torch-free: the lifecycle of every request, and which sequences run in the next step
with which tokens of each.

A request is added (waiting), admitted into a KV slot (running), and finished or aborted, which frees its
slot at once; the next `schedule()` reports it in `finished_ids`. Decoding sequences go first (one token
each) so running streams never stall behind a long prompt; the rest of the step's token budget prefills
waiting prompts in chunks, at most `prefill_while_decoding` tokens while sequences decode where that is set (a
step's prefill delays every running stream's next token). The scheduler decides when a sampled token ends a
sequence (a stop token, its token limit, the context); the engine applies it.

`schedule_ahead` is the next decode step scheduled before the last step's tokens are known (the engine's decode
ahead): each running sequence's token is the one being sampled (`FED`: the engine feeds it on the device), and a
sequence the last step ends (a stop token, a stop string) has run one step for nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.types import Request, RequestError, ScheduledSeq, SchedulerOutput

FED = -1  # a token id of `schedule_ahead`: the token the last step samples, fed on the device


@dataclass
class Sequence:
    request: Request
    stop_ids: frozenset[int] = frozenset()  # tokens that end it
    slot: int = -1
    num_computed: int = 0  # tokens whose KV is in the cache
    output_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def all_ids(self) -> list[int]:
        return [*self.request.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.requests: dict[str, Sequence] = {}  # every request added and not yet finished or aborted
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # hold a KV slot: prefilling or decoding
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._finished: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------------------
    def add(self, request: Request, stop_ids: frozenset[int] = frozenset()) -> Sequence:
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already running")
        seq = Sequence(request, stop_ids)
        self.requests[request.request_id] = seq
        self.waiting.append(seq)
        return seq

    def append_token(self, request_id: str, token: int) -> str | None:
        """Record a sampled token; why it ends the sequence ("stop": a stop token, "length": the token
        limit or the context), or None. The sequence runs on until `finish`."""
        seq = self.requests[request_id]
        seq.output_ids.append(token)
        if token in seq.stop_ids:
            return "stop"
        return "length" if self._at_limit(seq) else None

    def _at_limit(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether the sequence, `ahead` tokens on, has reached its token limit or the context."""
        return len(seq.output_ids) + ahead >= seq.request.params.max_tokens or \
            seq.num_tokens + ahead >= self.config.max_model_len

    def finish(self, request_id: str) -> Sequence:
        """End a request: its KV slot is free now."""
        seq = self.requests.pop(request_id)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        self._finished.append(request_id)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """End a request wherever it is; None when there is none of that id."""
        return self.finish(request_id) if request_id in self.requests else None

    # -- state -------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def is_waiting(self, request_id: str) -> bool:
        """Added and not yet given a KV slot."""
        seq = self.requests.get(request_id)
        return seq is not None and seq.slot < 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def kv_usage(self) -> float:
        used = sum(s.num_tokens for s in self.running)
        return used / (self.config.max_num_seqs * self.config.max_model_len)

    # -- the step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        decoding = [s for s in self.running if s.num_computed == s.num_tokens - 1]
        for seq in decoding:  # 1. every decoding sequence gets its next token
            seqs.append(self._chunk(seq, 1))
            budget -= 1
        if decoding and self.config.prefill_while_decoding:  # the decodes wait for the prompts beside them
            budget = min(budget, self.config.prefill_while_decoding)
        for seq in self.running:  # 2. prompts already admitted continue prefilling
            if budget > 0 and seq not in decoding:
                seqs.append(self._chunk(seq, budget))
                budget -= len(seqs[-1].token_ids)
        while budget > 0 and self.waiting and self.free_slots:  # 3. admit new prompts
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            seqs.append(self._chunk(seq, budget))
            budget -= len(seqs[-1].token_ids)
        finished, self._finished = tuple(self._finished), []
        return SchedulerOutput(tuple(seqs), finished)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step is decode steps alone and can be scheduled before the last step's tokens are known:
        every running sequence awaits its sampled token and no waiting prompt could take a free slot."""
        return bool(self.running) and all(s.num_computed == s.num_tokens for s in self.running) \
            and not (self.waiting and self.free_slots)

    def schedule_ahead(self) -> SchedulerOutput:
        """The next decode step while the last step's tokens are still being sampled (`can_schedule_ahead`): a `FED`
        token for each running sequence, but for those the last step's token ends by their token limit or the
        context. Each sequence's tokens are then one ahead of what it holds until its sampled token is appended."""
        seqs = []
        for seq in self.running:
            if self._at_limit(seq, ahead=1):
                continue
            seqs.append(ScheduledSeq(seq.request_id, seq.slot, seq.num_computed, (FED,), True))
            seq.num_computed += 1
        finished, self._finished = tuple(self._finished), []
        return SchedulerOutput(tuple(seqs), finished)

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledSeq:
        ids = seq.all_ids[seq.num_computed:seq.num_computed + budget]
        start = seq.num_computed
        seq.num_computed += len(ids)
        return ScheduledSeq(seq.request_id, seq.slot, start, tuple(ids), seq.num_computed == seq.num_tokens)
