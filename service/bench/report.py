"""A sweep as a terminal table and as JSON: every figure with its configuration, the routing, the machine
and its ceilings."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from service.bench.ceilings import Ceilings
from service.bench.results import ConfigResult, Skipped
from service.bench.runner import Phase, RunSettings

KB = 1e3


def routing_notice(spec: str) -> str:
    if spec == "model":
        return "routing: model (the model's routers choose the experts)"
    return f"routing: {spec} (router's choice replaced)"


def describe_machine(device: torch.device) -> dict[str, Any]:
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {"platform": platform.platform(), "processor": platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device),
            "accelerator": accelerator}


@dataclass(frozen=True)
class BenchReport:
    model: str
    routing: str
    machine: dict[str, Any]
    ceilings: Ceilings
    settings: RunSettings
    results: tuple[ConfigResult | Skipped, ...]
    date: str = ""

    def __post_init__(self) -> None:
        if not self.date:
            object.__setattr__(self, "date", datetime.now().isoformat(timespec="seconds"))


# ---- JSON ----

def _phase_json(p: Phase) -> dict[str, Any]:
    c = p.cache
    return {**asdict(p), "tokens_per_second": p.tokens_per_second, "hit_ratio": c.hit_ratio,
            "uploaded_bytes_per_token": p.per_token(c.uploaded_bytes),
            "streamed_bytes_per_token": p.per_token(c.streamed_bytes),
            "cpu_experts_per_token": p.per_token(c.cpu_experts),
            "cpu_seconds_per_token": p.per_token(c.cpu_seconds),
            "disk_read_bytes_per_token": p.per_token(c.disk_read_bytes),
            "ram_tier_hit_ratio": c.ram_hits / (c.ram_hits + c.ram_misses) if c.ram_hits + c.ram_misses else 0.0}


def _result_json(r: ConfigResult | Skipped) -> dict[str, Any]:
    if isinstance(r, Skipped):
        return {"config": asdict(r.point), "skipped": r.reason}
    out = {"config": asdict(r.point), **{k: v for k, v in asdict(r).items() if k not in ("point", "phases")}}
    if r.bound is not None:
        single = r.decode_at(1).tokens_per_second
        out["bound"] |= {"tokens_per_second": r.bound.tokens_per_second,
                         "share_of_bound": r.bound.share_of(single),
                         "share_of_host_bound": r.bound.host_share_of(single)}
    return {**out, "phases": [_phase_json(p) for p in r.phases]}


def report_json(report: BenchReport) -> dict[str, Any]:
    return {"model": report.model, "date": report.date,
            "routing": {"spec": report.routing, "replaced": report.routing != "model",
                        "notice": routing_notice(report.routing)},
            "machine": report.machine, "ceilings": asdict(report.ceilings),
            "settings": asdict(report.settings),
            "configurations": [_result_json(r) for r in report.results]}


def write_json(report: BenchReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report_json(report), indent=2) + "\n")


# ---- the table ----

COLUMNS = (("budget", 8), ("cache MiB", 9), ("cached", 7), ("policy", 6), ("miss", 6), ("batch", 5),
           ("tok/s", 8), ("hit", 6), ("up KB/tok", 9), ("stream KB/tok", 13), ("cpu exp/tok", 11), ("cpu ms/tok", 10),
           ("disk KB/tok", 11), ("prefill tok/s", 13), ("TTFT ms", 8), ("bound ms/tok", 12), ("of bound", 8),
           ("of host", 7))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS)) + " |"


def _rows(r: ConfigResult) -> list[str]:
    p = r.point
    head = [p.budget_label, f"{r.cache_bytes / 2**20:.1f}", f"{r.cached_share:.0%}", p.policy, p.miss_mode]
    prefill = [f"{r.prefill.tokens_per_second:.0f}", f"{r.prefill.ttft_seconds * 1e3:.1f}"]
    lines = []
    for n, d in enumerate(r.decode):
        bound = ["", "", ""]
        if d.batch == 1 and r.bound is not None:
            host = r.bound.host_share_of(d.tokens_per_second)
            bound = [f"{r.bound.seconds * 1e3:.3f}", f"{r.bound.share_of(d.tokens_per_second):.1%}",
                     "" if host is None else f"{host:.1%}"]
        decode = [str(d.batch), f"{d.tokens_per_second:.1f}", f"{d.hit_ratio:.1%}",
                  f"{d.uploaded_bytes_per_token / KB:.0f}", f"{d.streamed_bytes_per_token / KB:.0f}",
                  f"{d.cpu_experts_per_token:.1f}", f"{d.cpu_seconds_per_token * 1e3:.2f}",
                  f"{d.disk_bytes_per_token / KB:.0f}"]
        lines.append(_row(head + decode + (prefill if n == 0 else ["", ""]) + bound))
    return lines


def _placements(results: tuple[ConfigResult | Skipped, ...]) -> list[str]:
    seen = {(r.point.n_cpu_moe, r.num_host_layers, r.placement_reason) for r in results
            if isinstance(r, ConfigResult)}
    return [f"n-cpu-moe {n}: {layers} MoE layers' experts in host RAM ({why})"
            for n, layers, why in sorted(seen)]


def _header(report: BenchReport) -> list[str]:
    c, s = report.ceilings, report.settings
    zero_copy = "n/a" if c.zero_copy_gbps is None else f"{c.zero_copy_gbps:.3g} GB/s"
    batches = ", ".join(map(str, s.batches))
    return [f"model: {report.model}", routing_notice(report.routing),
            f"ceilings on {c.device}: link {c.link_gbps:.3g} GB/s{' (--link-gbps)' if c.link_capped else ''}, "
            f"zero-copy {zero_copy}, "
            f"HBM {c.hbm_gbps:.4g} GB/s, CPU read {c.cpu_read_gbps:.3g} GB/s, "
            f"CPU experts {c.cpu_expert_gbps:.3g} GB/s ({c.cpu_expert_path})"
            + ("" if c.at_once_gbps is None else
               f", link + CPU experts at once {c.at_once_gbps[0]:.3g} + {c.at_once_gbps[1]:.3g} GB/s"),
            f"prefill: {s.prompt_len} tokens; decode: {s.gen_len} tokens per request after a "
            f"{s.decode_prompt_len}-token prompt, batches {batches}; medians of {s.repeats} measured run(s) "
            f"after a warm-up{f' of {s.warmup_gen_len} tokens' if s.warmup_gen_len else ''}; "
            "bound: batch-1 decode (docs/benchmarks.md); of host: of the bound with link and CPU at once",
            *_placements(report.results)]


def format_table(report: BenchReport) -> str:
    lines = [*_header(report), "", _row([name for name, _ in COLUMNS]),
             "|" + "|".join("-" * (w + 1) + ":" for _, w in COLUMNS) + "|"]
    for r in report.results:
        if isinstance(r, Skipped):
            p = r.point
            lines.append(f"skipped: budget {p.budget_label}, {p.policy}, {p.miss_mode}: {r.reason}")
        else:
            lines += _rows(r)
    return "\n".join(lines)
