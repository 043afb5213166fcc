"""The step record: how one step routed and where each (token, expert) pair was computed.

The forward pass writes it on the device (the assign step writes the host layers' rows, the end of
the step the resident layers' expert ids); just after the step's launch (a graph's replay or the eager
forward) one copy takes it to one of two host buffers, in turn, so that a step launched before the last
one is read (`LLMEngine`'s decode ahead) never writes the copy being read. After the step has finished,
the engine takes a numpy copy (`StepRecord`), which the observers (stats, usage, profile, trace) and the
policies read while the next step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ops.cache_step import HIT, LANDED, ON_CPU, PAD, STAGED

__all__ = ["HIT", "LANDED", "ON_CPU", "PAD", "STAGED", "RecordBuffers", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    ids: np.ndarray  # int32 [moe_layers, pairs]: expert of each pair, -1 for none (padding)
    outcome: np.ndarray  # int32 [moe_layers, pairs]: HIT .. ON_CPU; PAD in the rows of resident layers
    slot: np.ndarray  # int32 [moe_layers, pairs]: the slot read (HIT) or landed in (LANDED), else -1
    num_tokens: int  # tokens of the step (a graph's padding rows excluded)
    is_prefill: bool  # a large batch: the cache was read, never changed

    @property
    def num_pairs(self) -> int:
        return int(self.ids.shape[1])


class RecordBuffers:
    """The device record `[max_pairs, 3 (ids, outcome, slot), moe_layers]` (int32: a step's pairs are its
    first rows, one contiguous copy to the host) and its two host copies (pinned on CUDA), used in turn."""

    def __init__(self, num_layers: int, max_pairs: int, device: torch.device) -> None:
        self.device = torch.zeros((max_pairs, 3, num_layers), dtype=torch.int32, device=device)
        self.host = torch.zeros((2, *self.device.shape), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.turn = 0  # the host copy the last step's record went to

    def layer(self, row: int) -> torch.Tensor:
        """`[max_pairs, 3]` view of one layer's part (what `ops.cache_step.assign_experts` writes)."""
        return self.device[:, :, row]

    def reset(self, num_pairs: int) -> None:
        """Every field of the step's pairs -1: ids none, outcome PAD, slot none."""
        self.device[:num_pairs] = -1

    def copy_to_host(self, num_pairs: int) -> int:
        """Just after a step's launch, never inside a graph: its pairs to the next host copy, one copy ordered
        after the step; returns that copy's index for `take`."""
        self.turn ^= 1
        self.host[self.turn, :num_pairs].copy_(self.device[:num_pairs], non_blocking=True)
        return self.turn

    def take(self, turn: int, num_pairs: int, num_tokens: int, is_prefill: bool) -> StepRecord:
        """A numpy copy of a finished step's record (call once the step has finished on the device)."""
        data = self.host[turn, :num_pairs].numpy().transpose(1, 2, 0).copy()  # [3, layers, pairs]
        return StepRecord(data[0], data[1], data[2], num_tokens, is_prefill)


def unique_experts(record: StepRecord, rows: np.ndarray, outcome: int) -> set[tuple[int, int]]:
    """(row, expert) of the pairs with `outcome` in the given rows, each once."""
    sel = record.outcome[rows] == outcome
    layer_rows = np.broadcast_to(rows[:, None], record.ids[rows].shape)
    return set(zip(layer_rows[sel].tolist(), record.ids[rows][sel].tolist()))


def is_miss(outcome: np.ndarray) -> np.ndarray:
    return (outcome == STAGED) | (outcome == LANDED) | (outcome == ON_CPU)
