"""The device side of the expert cache: banks of experts (slot pools, staging) and copies off the critical path.

On CUDA, copies run on a dedicated copy stream and complete through CUDA events. On a CPU device the
same protocol runs with one copy thread, so every invariant is exercised without a GPU.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from ops.bank import ExpertWeights


@dataclass(frozen=True)
class LinkCap:
    """A slower host link than the machine's, simulated (`--link-gbps`, CUDA only): each host -> device copy
    of expert bytes is followed on its stream by a wait of the time the slower link would add."""

    gbps: float
    measured_gbps: float  # the machine's own link

    def extra_ns(self, num_bytes: int) -> int:
        """Bytes over GB/s are nanoseconds."""
        return max(0, round(num_bytes / self.gbps - num_bytes / self.measured_gbps))


class CopyEngine:
    """Asynchronous host -> device copies that never block the compute stream."""

    def __init__(self, device: torch.device, cap: LinkCap | None = None) -> None:
        self.device, self.cap = device, cap
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
        else:
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="moecache-copy")

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyHandle:
        """Copy each (dst, src); the handle completes when all are done."""
        if self.device.type == "cuda":
            # NOTE: slots may still be read by the step just launched: wait for it before overwriting.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            return CopyHandle(event=self._copy_on_stream(pairs))
        return CopyHandle(future=self.thread.submit(copy_pairs, pairs))

    def upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
               after: torch.cuda.Event | None) -> torch.cuda.Event:
        """CUDA only: copy each (dst, src) once `after` has happened (not after the whole compute
        stream, as `copy` waits): staging buffers wait only for their last reader."""
        if after is not None:
            self.stream.wait_event(after)
        return self._copy_on_stream(pairs)

    def gather(self, sources: list[list[int]], rows: list[int], dsts: tuple[torch.Tensor, ...], host_bytes: int,
               after: torch.cuda.Event | None) -> torch.cuda.Event:
        """CUDA only: dsts[i][rows[j]] = the expert matrix at address sources[i][j] (a VRAM slot or pinned host
        memory), one launch a matrix (`ops.triton.gather_experts`), once `after` has happened; host_bytes: the bytes
        read from the host."""
        from ops.triton import gather_experts

        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            # NOTE: the caching host allocator keeps the pinned table until the stream has read it
            table = torch.tensor([*sources, rows], dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
            for i, dst in enumerate(dsts):
                gather_experts(table[i], table[len(sources)], dst)
            return self._finish(host_bytes)

    def _copy_on_stream(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return self._finish(sum(s.nbytes for _, s in pairs if s.device.type == "cpu"))

    def _finish(self, host_bytes: int) -> torch.cuda.Event:
        """On the copy stream: the slower link's wait where one is simulated, then the event of the copies."""
        if self.cap is not None:
            from ops.triton import hold

            hold(self.cap.extra_ns(host_bytes), self.device)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def close(self) -> None:
        if self.device.type != "cuda":
            self.thread.shutdown(wait=True)


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (dst, src) now, in the calling thread."""
    for dst, src in pairs:
        dst.copy_(src)


@dataclass
class CopyHandle:
    event: torch.cuda.Event | None = None
    future: Future | None = None

    def done(self) -> bool:
        if self.event is not None:
            return self.event.query()
        assert self.future is not None, "a copy handle holds an event or a future"
        return self.future.done()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        else:
            assert self.future is not None, "a copy handle holds an event or a future"
            self.future.result()


def empty_bank(like: ExpertWeights, rows: int, device: torch.device) -> ExpertWeights:
    """An uninitialised bank of `rows` experts shaped like `like` (slot pools, staging buffers), plain math:
    its rows are not the layer's experts."""
    new = lambda t: torch.empty((rows, *t.shape[1:]), dtype=torch.uint8, device=device)  # noqa: E731
    return ExpertWeights(new(like.gate), new(like.up), new(like.down), like.gate_type, like.up_type,
                         like.down_type, like.hidden, like.ff)


def bank_shape(bank: ExpertWeights) -> tuple:
    """Types and shapes of a bank's experts: banks of one shape can stand in for each other's rows."""
    return (bank.gate_type, bank.up_type, bank.down_type, tuple(bank.gate.shape[1:]), tuple(bank.down.shape[1:]))


def bank_to(bank: ExpertWeights, device: torch.device) -> ExpertWeights:
    """A whole layer of experts copied to the device (resident layers)."""
    if bank.gate.device == device:
        return bank
    move = lambda t: t.to(device)  # noqa: E731
    return replace(bank, gate=move(bank.gate), up=move(bank.up), down=move(bank.down), math=bank.math.to(device))


def expert_parts(bank: ExpertWeights, row: int | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return bank.gate[row], bank.up[row], bank.down[row]
