"""Decode tokens/s and hit ratio against the cache budget: two panels, one line per (policy, miss mode),
at the smallest batch of the sweep."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display

import matplotlib.pyplot as plt  # noqa: E402

from service.bench.report import BenchReport, routing_notice  # noqa: E402
from service.bench.results import ConfigResult  # noqa: E402

Line = list[tuple[float, float, float]]  # (budget MiB, tokens/s, hit ratio), by budget


def lines(results: Sequence[ConfigResult], batch: int) -> dict[str, Line]:
    """One line per (policy, miss mode), and per placement when the sweep has several."""
    placements = {r.point.n_cpu_moe for r in results}
    out: dict[str, Line] = defaultdict(list)
    for r in results:
        label = f"{r.point.policy}, misses on {r.point.miss_mode}"
        label += f", n-cpu-moe {r.point.n_cpu_moe}" if len(placements) > 1 else ""
        d = r.decode_at(batch)
        out[label].append((r.applied_budget_mib, d.tokens_per_second, d.hit_ratio))
    return {label: sorted(points) for label, points in out.items()}


def write_plot(report: BenchReport, path: str | Path) -> None:
    results = [r for r in report.results if isinstance(r, ConfigResult)]
    batch = min(report.settings.batches)
    fig, (speed, hits) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in lines(results, batch).items():
        budgets = [p[0] for p in points]
        speed.plot(budgets, [p[1] for p in points], marker="o", label=label)
        hits.plot(budgets, [p[2] for p in points], marker="o", label=label)
    speed.set(xlabel="expert cache budget (MiB)", ylabel=f"decode tokens/s (batch {batch})")
    hits.set(xlabel="expert cache budget (MiB)", ylabel=f"hit ratio (batch {batch} decode)", ylim=(0, 1))
    speed.legend(fontsize="small")
    for ax in (speed, hits):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(report.model).name}: {routing_notice(report.routing)}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
