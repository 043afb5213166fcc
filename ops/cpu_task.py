"""One layer's CPU task over a `CpuJob`: the pairs the job flags for the CPU, computed from the layer's
experts in host RAM into the job's output (zeros where a token has none)."""

from __future__ import annotations

import time

import torch

from ops.cache_step import CpuJob
from ops.cpu_experts import ExpertWeights, expert_ffn_cpu


class CpuTask:
    """A task run by Python (`run`); `function`/`argument` are 0: it cannot be a CUDA host node."""

    function = 0
    argument = 0

    def __init__(self, bank: ExpertWeights, job: CpuJob, num_threads: int) -> None:
        self.bank, self.job, self.num_threads = bank, job, num_threads
        self._counts = [0, 0, 0, 0, 0]  # calls, pairs, experts, bytes, busy ns

    def run(self) -> None:
        start = time.perf_counter_ns()
        job, top_k = self.job, self.job.expert_ids.shape[0] // self.job.x.shape[0]
        num_tokens = int(job.num_tokens[0])
        pairs = (job.on_cpu[:num_tokens * top_k] != 0).nonzero()[:, 0]
        experts = job.expert_ids[pairs].long()
        out = expert_ffn_cpu(job.x[:num_tokens], pairs // top_k, experts, job.weights[pairs], self.bank,
                             num_threads=self.num_threads) if len(pairs) else torch.zeros(num_tokens, job.x.shape[1])
        job.out[:num_tokens] = out
        distinct = int(experts.unique().numel())
        for i, n in enumerate((1, len(pairs), distinct, distinct * self.bank.expert_bytes,
                               time.perf_counter_ns() - start)):
            self._counts[i] += n

    def counters(self) -> tuple[int, int, int, int, int]:
        """(calls, pairs, experts, bytes of distinct experts, busy nanoseconds), cumulative."""
        c = self._counts
        return c[0], c[1], c[2], c[3], c[4]


def cpu_task(bank: ExpertWeights, job: CpuJob, num_threads: int) -> CpuTask:
    return CpuTask(bank, job, num_threads)
