"""Perplexity and KL-divergence statistics of a run against a base run, computed as llama.cpp's
`llama-perplexity --kl-divergence` computes them (`tools/perplexity/perplexity.cpp`): KL(base || run)
over the tokens whose base log-probability is above -16, Δp = p(token) - p_base(token), and whether
both runs put the same token on top."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_BASE_LOGPROB = -16.0  # base tokens below count nothing in the KL sum


@dataclass
class Perplexity:
    """Negative log-likelihoods of the scored tokens, in order."""

    nll: list[float] = field(default_factory=list)

    def add(self, logprobs: np.ndarray, targets: np.ndarray) -> None:
        """logprobs `[rows, vocab]`, targets `[rows]`: the token each row predicts."""
        self.nll.extend((-logprobs[np.arange(len(targets)), targets]).tolist())

    @property
    def value(self) -> float:
        return math.exp(float(np.mean(self.nll)))

    @property
    def uncertainty(self) -> float:
        """llama.cpp's +/-: the standard error of the mean nll, times the perplexity."""
        return self.value * _stderr(np.asarray(self.nll))


@dataclass
class Divergence:
    """Per scored token: the run's and the base's nll, the KL divergence, Δp and the same-top flag."""

    run: Perplexity = field(default_factory=Perplexity)
    base: Perplexity = field(default_factory=Perplexity)
    kld: list[float] = field(default_factory=list)
    p_diff: list[float] = field(default_factory=list)
    same_top: list[bool] = field(default_factory=list)

    def add(self, logprobs: np.ndarray, base: np.ndarray, targets: np.ndarray) -> None:
        """logprobs and base `[rows, vocab]` (log-probabilities), targets `[rows]`."""
        self.run.add(logprobs, targets)
        self.base.add(base, targets)
        kept = base > MIN_BASE_LOGPROB
        self.kld.extend(np.where(kept, np.exp(base) * (base - logprobs), 0.0).sum(axis=1).tolist())
        rows = np.arange(len(targets))
        self.p_diff.extend((np.exp(logprobs[rows, targets]) - np.exp(base[rows, targets])).tolist())
        self.same_top.extend((logprobs.argmax(axis=1) == base.argmax(axis=1)).tolist())

    @property
    def count(self) -> int:
        return len(self.kld)

    def summary(self) -> dict[str, float]:
        """The figures llama.cpp prints, plus the largest |Δ log p| of a scored token."""
        kld, p_diff = np.asarray(self.kld), np.asarray(self.p_diff)
        ratio = np.asarray(self.run.nll) - np.asarray(self.base.nll)
        same = float(np.mean(self.same_top))
        return {
            "tokens": self.count,
            "ppl": self.run.value, "ppl_base": self.base.value,
            "ln_ppl_ratio": float(ratio.mean()), "ln_ppl_ratio_unc": _stderr(ratio),
            "mean_kld": float(kld.mean()), "mean_kld_unc": _stderr(kld), "max_kld": float(kld.max()),
            "kld_99.9": float(np.percentile(kld, 99.9)), "kld_99": float(np.percentile(kld, 99)),
            "median_kld": float(np.median(kld)),
            "max_abs_dlogprob": float(np.abs(ratio).max()),
            "rms_dp": float(np.sqrt(np.mean(p_diff ** 2))), "max_dp": float(p_diff.max()),
            "min_dp": float(p_diff.min()),
            "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / max(self.count - 1, 1)),
        }  # fmt: skip


def report(s: dict[str, float]) -> str:
    """The summary as llama.cpp lays out its statistics."""
    return "\n".join([
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f}",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_unc']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['mean_kld']:10.6f} ± {s['mean_kld_unc']:10.6f}",
        f"Maximum KLD: {s['max_kld']:10.6f}",
        f"99.9%   KLD: {s['kld_99.9']:10.6f}",
        f"99.0%   KLD: {s['kld_99']:10.6f}",
        f"Median  KLD: {s['median_kld']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Maximum Δp: {100 * s['max_dp']:6.3f}%",
        f"Minimum Δp: {100 * s['min_dp']:6.3f}%",
        f"RMS Δp    : {100 * s['rms_dp']:6.3f} %",
        f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %",
        f"Max |Δ log p| of a token: {s['max_abs_dlogprob']:.6f}",
    ])  # fmt: skip


def _stderr(values: np.ndarray) -> float:
    # as llama.cpp: 0 below 11 values
    if values.size <= 10:
        return 0.0
    variance = float(np.mean(values ** 2) - np.mean(values) ** 2)
    return math.sqrt(variance / (values.size - 1)) if variance > 0 else 0.0
