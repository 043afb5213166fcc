"""Continuous batching, torch-free: which sequences run in the next step, and which tokens of each.

Decoding sequences go first (one token each) so running streams never stall behind a long prompt; the
rest of the step's token budget prefills waiting prompts in chunks. A finished or aborted sequence
frees its KV slot at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.types import Request, ScheduledSeq, SchedulerOutput


@dataclass
class Sequence:
    request: Request
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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # hold a KV slot: prefilling or decoding
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._finished: list[str] = []

    def add(self, request: Request) -> Sequence:
        seq = Sequence(request)
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        self._finished.append(seq.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_usage(self) -> float:
        used = sum(s.num_tokens for s in self.running)
        return used / (self.config.max_num_seqs * self.config.max_model_len)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        decoding = [s for s in self.running if s.num_computed == s.num_tokens - 1]
        for seq in decoding:  # 1. every decoding sequence gets its next token
            seqs.append(self._chunk(seq, 1))
            budget -= 1
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

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledSeq:
        ids = seq.all_ids[seq.num_computed:seq.num_computed + budget]
        start = seq.num_computed
        seq.num_computed += len(ids)
        return ScheduledSeq(seq.request_id, seq.slot, start, tuple(ids), seq.num_computed == seq.num_tokens)

    def append_token(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
