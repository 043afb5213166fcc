"""`moecache bench`: decode and prefill speed, expert-cache figures and the machine's bound per cache
configuration; a sweep is applied with `reconfigure_cache` to one loaded engine."""

from __future__ import annotations

import argparse
import sys

from engine.config import MISS_MODES, POLICIES, EngineConfig
from engine.llm_engine import LLMEngine
from service.bench.ceilings import ExpertShape, measure_ceilings
from service.bench.report import BenchReport, describe_machine, format_table, routing_notice, write_json
from service.bench.results import run_sweep
from service.bench.runner import RunSettings
from service.bench.sweep import SweepPoint, comma_list, fraction, sweep_points
from service.engine_setup import ROUTING_HELP, load_engine
from service.options import add_engine_options, engine_config
from service.progress import ProgressBar


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # "resolve": the sweep options below replace the single-valued engine options of the same names
    p = sub.add_parser("bench", conflict_handler="resolve", help="measure decode/prefill speed and the "
                       "expert cache over a sweep of cache configurations, beside the machine's bound")
    add_engine_options(p)
    _add_run_options(p)
    _add_sweep_options(p)
    p.set_defaults(run=run)
    return p


def _add_run_options(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("runs")
    r.add_argument("--batches", type=comma_list(int), default="1,8,32", help="requests decoding together")
    r.add_argument("--prompt-len", type=int, default=512, help="tokens of the prefill request")
    r.add_argument("--decode-prompt-len", type=int, default=16, help="prompt of each decoding request")
    r.add_argument("--gen-len", type=int, default=128, help="tokens each decoding request generates")
    r.add_argument("--repeats", type=int, default=3, help="measured runs (medians) after one warm-up run")
    r.add_argument("--warmup-gen-len", type=int, default=0, help="tokens each decoding request generates in the "
                   "warm-up run (default: --gen-len); a long warm-up lets policies that promote a few experts a "
                   "step (decay, lfru) fill the cache before the measured runs")
    r.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    r.add_argument("-c", "--ctx-size", type=int, default=None, help="context per sequence (default: what the "
                   "longest request needs)")
    r.add_argument("--routing", default="model", help=f"{ROUTING_HELP} (anything but model replaces the routers' "
                   "choice of experts)")
    r.add_argument("--json", default=None, metavar="FILE",
                   help="every figure with its configuration and the machine")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="tokens/s and hit ratio against cache budget")


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sweep (comma-separated lists; every combination is measured)")
    budget = s.add_mutually_exclusive_group()
    budget.add_argument("--budget-mib", "--moe-cache-mib", type=comma_list(int), default=None,
                        metavar="MIB,...", help="cache budgets (default: the automatic budget)")
    budget.add_argument("--budget-frac", type=comma_list(fraction), default=None, metavar="F,...",
                        help="cache budgets as a share of the routed expert bytes in host RAM (0: no cache)")
    s.add_argument("--policy", "--cache-policy", type=comma_list(str, POLICIES), default="decay",
                   metavar="P,...", help=f"cache policies ({', '.join(POLICIES)})")
    s.add_argument("--miss-mode", type=comma_list(str, MISS_MODES), default="cpu", metavar="M,...",
                   help=f"where misses are computed ({', '.join(MISS_MODES)})")
    s.add_argument("--n-cpu-moe", type=comma_list(int), default="0", metavar="N,...",
                   help="routed experts of the first N MoE layers in host RAM")


def settings_of(args: argparse.Namespace) -> RunSettings:
    return RunSettings(args.prompt_len, args.decode_prompt_len, args.gen_len, tuple(args.batches),
                       args.repeats, args.seed, args.warmup_gen_len)


def points_of(args: argparse.Namespace) -> list[SweepPoint]:
    return sweep_points(args.policy, args.miss_mode, args.n_cpu_moe, args.budget_mib or (None,),
                        args.budget_frac or ())


def base_config(args: argparse.Namespace, settings: RunSettings, first: SweepPoint) -> EngineConfig:
    """The engine's config with no cache (each sweep point replaces it) and a context that fits the runs."""
    if max(settings.batches) > args.max_num_seqs:
        raise ValueError(f"batch {max(settings.batches)} exceeds --max-num-seqs {args.max_num_seqs}")
    scalar = {"cache_policy": first.policy, "miss_mode": first.miss_mode, "n_cpu_moe": first.n_cpu_moe,
              "moe_cache_mib": 0, "ctx_size": args.ctx_size or settings.context_len}
    return engine_config(argparse.Namespace(**{**vars(args), **scalar}))


def run(args: argparse.Namespace) -> int:
    settings, points = settings_of(args), points_of(args)
    print(routing_notice(args.routing), flush=True)
    engine = load_engine(base_config(args, settings, points[0]), ProgressBar())  # routing: per configuration
    try:
        ceilings = measure_ceilings(engine.device, _expert_shape(engine), args.cpu_threads).capped(args.link_gbps)

        def report_of(results: list) -> BenchReport:
            return BenchReport(str(engine.gguf.path), args.routing, describe_machine(engine.device), ceilings,
                               settings, tuple(results))

        results = run_sweep(engine, points, settings, args.routing, ceilings,
                            progress=lambda line: print(line, file=sys.stderr, flush=True),
                            on_result=(lambda rs: write_json(report_of(rs), args.json)) if args.json else None)
    finally:
        engine.close()
    report = report_of(results)
    print(format_table(report))
    if args.plot:
        from service.bench.plot import write_plot  # matplotlib only when a plot is asked for

        write_plot(report, args.plot)
    return 0


def _expert_shape(engine: LLMEngine) -> ExpertShape:
    if not engine.weights.moe_layers:
        raise ValueError(f"{engine.gguf.path} has no MoE layers: nothing to cache")
    first = engine.weights.moe_layers[0]
    return ExpertShape.of(engine.store.mapped[first], engine.weights.hparams.top_k)

