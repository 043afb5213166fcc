"""What a routed expert computes between its matrices: `down(act(gate x + b_gate, up x + b_up)) + b_down`.

The plain case, `down(silu(gate x) * up x)` without biases, is what the fused Triton grouped GEMV computes.
Biases and other activations (gpt-oss's clamped SwiGLU, Gemma's GELU) take the paths that read an `ExpertMath`
beside the expert bytes: the torch reference, the native CPU kernel (`ops/csrc/layer.h`'s `moe_math`), the
Triton gather path, the grouped GEMM.

NOTE: a math's biases are indexed like the rows of the bank or tables it belongs to: expert ids for a layer's
bank (host, resident, staged) and its pointer tables; a slot pool's math is gathered for its slots (`at_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F

Activation = Literal["silu", "swiglu_oai", "gelu"]


@dataclass(frozen=True)
class ExpertMath:
    activation: Activation = "silu"
    gate_bias: torch.Tensor | None = None  # float32 [rows, ff]
    up_bias: torch.Tensor | None = None  # float32 [rows, ff]
    down_bias: torch.Tensor | None = None  # float32 [rows, hidden]
    alpha: float = 1.702  # swiglu_oai: min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up) + 1)
    limit: float = 7.0

    @property
    def is_plain(self) -> bool:
        """SiLU-gated, no biases: the fast kernels' case."""
        return self.activation == "silu" and self.gate_bias is None and self.up_bias is None \
            and self.down_bias is None

    def to(self, device: torch.device) -> ExpertMath:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, gate_bias=move(self.gate_bias), up_bias=move(self.up_bias),
                       down_bias=move(self.down_bias))

    def at_rows(self, source_rows: torch.Tensor) -> ExpertMath:
        """The math of a bank whose row r holds this math's row `source_rows[r]` (-1: none, biases 0)."""
        def gather(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            rows = source_rows.to(t.device)
            return torch.where((rows >= 0)[:, None], t[rows.clamp(min=0)], 0.0)

        return replace(self, gate_bias=gather(self.gate_bias), up_bias=gather(self.up_bias),
                       down_bias=gather(self.down_bias))

    def hidden(self, gate: torch.Tensor, up: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """gate, up float32 `[pairs, ff]` (x through the row's matrices), rows `[pairs]` -> `[pairs, ff]`."""
        gate, up = _biased(gate, self.gate_bias, rows), _biased(up, self.up_bias, rows)
        if self.activation == "silu":
            return F.silu(gate) * up
        if self.activation == "gelu":
            return F.gelu(gate, approximate="tanh") * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + 1)

    def output(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """y float32 `[pairs, hidden]` (h through the row's down matrix) -> with the down bias."""
        return _biased(y, self.down_bias, rows)


PLAIN = ExpertMath()


def _biased(x: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    if bias is None:
        return x
    # NOTE: rows out of range (a skipped pair's) read a clamped row; their result is discarded
    return x + bias[rows.clamp(0, bias.shape[0] - 1).to(bias.device)].to(x.dtype)
